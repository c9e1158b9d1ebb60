"""The app's stages, on the runtime's seam (:class:`streams.stage.Stage`): intake, OCR, extraction, gallery.

::

    intake.raw.documents ─► intake ─► intake.ingest.documents ─► ocr ─► intake.ocr.lines ─► extract
      (HTTP upload, Kafka)    │                                  (Triton)                     │
                              └─► intake.ingest.receipts ─────────────► rules ◄─ intake.predictions.documents
                                   (hashes, gallery match)       (streams.rules) ─► intake.actions.{approve,review,reject}
                                                                                      └─► gallery (approved → Redis)

Decode, dead letters with the reason, encoding and headers are the seam's; what is here is the app.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
import redis
from prometheus_client import Counter, Gauge, Histogram
from pydantic import Field

from inference_workers.triton_client import ModelContract, ModelRepository, TritonModel
from intake_app.extraction import extract, load_spec
from intake_app.gallery import Gallery
from intake_app.images import DuplicateContent, check_image
from intake_app.models import read_characters
from intake_app.ocr import (
    CLS,
    DET,
    REC,
    Line,
    OcrEngine,
    OcrSettings,
    Timings,
    decode_image,
)
from streams.context import BuildContext
from streams.delivery import Record
from streams.errors import (
    BackpressureError,
    InferenceError,
    InferenceUnavailableError,
    PayloadError,
    ServiceUnavailableError,
)
from streams.payloads import PayloadStore
from streams.resilience import REDIS_FAILURES, Guard
from streams.rules.degradation import LevelController
from streams.rules.spec import DegradationSpec, Level, Trigger
from streams.stage import Emit, Sink, Stage, StageSettings

log = logging.getLogger("tangram.intake")

# The seeds' four golden signals of an OCR service, as Prometheus metrics.
INPUT_VALID = Gauge("tangram_intake_input_valid_ratio", "Share of the last uploads the intake accepted (input_valid_rate).",
                    ["processor"])
TRITON_OOM = Counter("tangram_intake_triton_oom_total", "Triton calls refused for lack of memory (gpu_oom_count).",
                     ["processor"])
CONFIDENCE_P50 = Gauge("tangram_intake_output_confidence_p50", "Median line confidence of the last OCR batches "
                       "(output_confidence_p50).", ["processor"])
OCR_SECONDS = Histogram("tangram_intake_ocr_seconds", "OCR time of one micro-batch of documents, by step "
                        "(latency_p99_ms comes from step=total).", ["processor", "step"],
                        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32))
SKIPPED = Counter("tangram_intake_ocr_skipped_total", "Documents not read by OCR, by degradation level.",
                  ["processor", "level"])


def _redis(ctx: BuildContext) -> tuple[redis.Redis, Guard]:
    """A Redis client with the processor's declared deadline, and the guard its calls go through."""
    guard = ctx.calls.guard("redis", REDIS_FAILURES)
    return redis.Redis.from_url(ctx.stack.redis_url, socket_timeout=guard.timeout_s,
                                socket_connect_timeout=guard.timeout_s), guard


def _key_prefix(ctx: BuildContext, configured: str | None) -> str:
    """The prefix of the app's Redis keys: the one configured, else the topology's app name (a namespaced copy's
    own, as its topics are)."""
    return configured or ctx.topology.app


def _redis_call(guard: Guard, what: str, call: Any) -> Any:
    """A Redis call under the processor's declared deadline, retries and breaker (``calls:``); Redis being
    down is backpressure (the batch is retried), never the record's fault."""
    try:
        return guard.call(call)
    except ServiceUnavailableError as exc:
        raise ServiceUnavailableError(f"Redis unavailable while {what}: {exc}", "redis") from exc


class Intake(Stage):
    """Uploads → checked documents (to OCR) and their receipts (hashes and the gallery's nearest match)."""

    services = frozenset({"redis", "registry"})  # dedup and the gallery; the codecs

    class Settings(StageSettings):
        documents_topic: str = Field(description="Where accepted documents go (OCR reads them).")
        receipts_topic: str = Field(description="Where each accepted document's receipt goes (the rules read them).")
        max_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="Larger uploads are refused (oversize).")
        min_side: int = Field(320, ge=16, description="Narrower images are refused (bad_dimensions).")
        max_side: int = Field(6000, ge=64, description="Wider images are refused (bad_dimensions).")
        phash_size: int = Field(16, ge=8, le=32, description="Perceptual hash side: phash_size² bits.")
        dedup_ttl_s: int = Field(86_400, ge=1, description="How long an upload's content digest is remembered.")
        key_prefix: str | None = Field(None, description="Prefix of this app's Redis keys (dedup, gallery); default "
                                                         "the topology's app name, so that a namespaced copy (a test, "
                                                         "a backtest, `tangram chaos`) keeps keys of its own as it "
                                                         "keeps topics of its own.")
        valid_window: int = Field(200, ge=1, description="Uploads over which input_valid_rate is measured.")

    def __init__(self, ctx: BuildContext):
        super().__init__(ctx)
        self.redis, self.guard = _redis(ctx)
        self.payloads = PayloadStore.of(ctx.topology, ctx.stack)
        self.prefix = _key_prefix(ctx, self.settings.key_prefix)
        self.gallery = Gallery(self.redis, f"{self.prefix}:gallery")
        self._outcomes: deque[bool] = deque(maxlen=self.settings.valid_window)

    def setup(self) -> None:
        _redis_call(self.guard, "connecting", self.redis.ping)

    def transform_batch(self, values: Sequence[dict], records: Sequence[Record]) -> list[Any]:
        _redis_call(self.guard, "reading the gallery", self.gallery.refresh)
        results = super().transform_batch(values, records)
        self._outcomes.extend(not isinstance(r, BaseException) for r in results)
        INPUT_VALID.labels(self.name).set(sum(self._outcomes) / len(self._outcomes))
        return results

    def transform(self, value: dict, record: Record) -> list[Emit]:
        s = self.settings
        image = check_image(self.payloads.value(value, "image"), max_bytes=s.max_bytes, min_side=s.min_side,
                            max_side=s.max_side, phash_size=s.phash_size)
        key = f"{self.prefix}:sha256:{image.sha256}"
        first = _redis_call(self.guard, "deduplicating", lambda: self.redis.set(key, value["doc_id"], nx=True, ex=s.dedup_ttl_s))
        if not first:
            owner = (_redis_call(self.guard, "deduplicating", lambda: self.redis.get(key)) or b"").decode()
            if owner != value["doc_id"]:  # the same document read again after a crash is not a duplicate
                raise DuplicateContent(f"same content as document {owner} (sha256 {image.sha256[:16]}...)")
        match = self.gallery.nearest(image.phash)
        common = {"doc_id": value["doc_id"], "device_id": value["device_id"], "uploaded_ms": value["uploaded_ms"],
                  "image_sha256": image.sha256, "image_phash": image.phash}
        document = {**common, "format": image.format, "width": image.width, "height": image.height,
                    "colour_mode": image.colour_mode, "converted": image.converted,
                    **self.payloads.inline(image.data, "image")}
        receipt = {**common, "gallery_doc_id": match.doc_id, "gallery_distance": match.distance,
                   "doc_type": match.doc_type, "fields": match.fields}
        return [Emit(document, topic=s.documents_topic, event_id=value["doc_id"]),
                Emit(receipt, topic=s.receipts_topic, event_id=f"receipt:{value['doc_id']}")]

    def close(self) -> None:
        self.redis.close()


class Ocr(Stage):
    """Documents → their text lines, read by the PP-OCR models Triton serves.

    Follows the degradation level: the config center's switch (``feature-switch/degradation.level``)
    and its own golden signal, the p99 of its batches' OCR time over ``signal_window_s``, through the
    declared ``triggers`` (the rule processor's trigger model). At L1 it skips ``low_priority_model``
    (the direction classifier); from L2 on it reads nothing (the rules decide from the gallery).
    Its Triton calls go through the processor's guard: the deadline, retries and breaker its ``calls:``
    declare.
    """

    services = frozenset({"triton", "registry"})
    reloads_live = True  # the config center's degradation switch, without a restart (``live_config``)

    class Settings(StageSettings):
        low_priority_model: str = Field(CLS, description="The model skipped at degradation level L1.")
        det_limit: int = Field(OcrSettings.det_limit, ge=64, description="Longest side given to the detector.")
        rec_batch: int = Field(OcrSettings.rec_batch, ge=1, le=64, description=(
            "Text lines a recogniser request, grouped by width. On a CPU one line a request is fastest (no padding, "
            "docs/intake.md); on a GPU larger requests are what its throughput comes from."))
        triggers: tuple[Trigger, ...] = Field((), description="Own level triggers (signal inference_p99_ms).")
        signal_window_s: float = Field(60.0, gt=0, description="Window of the OCR-time p99 signal.")
        config_topic: str = Field("_tangram.config", description="The config center's topic.")
        live_config: bool = Field(True, description="Follow the config center's degradation switch.")

    def __init__(self, ctx: BuildContext):
        super().__init__(ctx)
        repository = ctx.topology.model_repository
        self.contracts = {m: ModelContract.from_config(repository / m) for m in (DET, REC, CLS)}
        self.characters = read_characters(repository / REC)
        self.url = ctx.stack.triton_grpc_url
        self.guard = ctx.calls.guard("triton", (InferenceUnavailableError,))
        self.kafka = ctx.stack.kafka
        self.payloads = PayloadStore.of(ctx.topology, ctx.stack)
        self.levels = LevelController(DegradationSpec(triggers=self.settings.triggers, window_s=self.settings.signal_window_s),
                                      ctx.name)
        self._latencies: deque[tuple[float, float]] = deque()
        self._confidences: deque[float] = deque(maxlen=2000)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.models: dict[str, TritonModel] = {}
        self.versions: dict[str, str] = {}
        self.config: Any = None

    def setup(self) -> None:
        self.loop = asyncio.new_event_loop()
        if self.settings.live_config:
            from streams.config_center import ConfigSubscriber
            from streams.statelog import StateTopic

            StateTopic(self.kafka, self.settings.config_topic).ensure()
            self.config = ConfigSubscriber(self.kafka, self.settings.config_topic, name=self.name,
                                           namespaces=["feature-switch"])
            self.config.start()

    async def _connect(self) -> None:
        """The three models, each checked against the contract of its config.pbtxt, and their served versions."""
        async with ModelRepository(self.url) as repository:
            for name in (DET, REC, CLS):
                model = TritonModel(self.url, name, timeout_s=self.guard.timeout_s, contract=self.contracts[name])
                await model.setup()
                self.models[name] = model
                self.versions[name] = max(await repository.ready_versions(name), key=int)
        log.info("%s: OCR models %s", self.name, ", ".join(f"{m} v{v}" for m, v in self.versions.items()))

    async def _infer(self, model: str, batch: np.ndarray) -> np.ndarray:
        return await self.guard.acall(self.models[model].infer, batch)

    def level(self) -> Level:
        """The level in effect: the config center's switch, raised by this stage's own triggers."""
        if self.config is not None:
            manual = self.config.get("feature-switch", "degradation.level", "L0")
            if manual != self.levels.manual:
                self.levels.set_manual(manual)
        horizon = time.monotonic() - self.settings.signal_window_s
        while self._latencies and self._latencies[0][0] < horizon:
            self._latencies.popleft()
        p99 = float(np.percentile([v for _, v in self._latencies], 99)) if len(self._latencies) >= 3 else None
        return self.levels.update({"inference_p99_ms": p99})

    def transform_batch(self, values: Sequence[dict], records: Sequence[Record]) -> list[Any]:
        assert self.loop is not None, "setup() first"
        level = self.level()
        if level in ("L2", "L3"):
            SKIPPED.labels(self.name, level).inc(len(values))
            return [None] * len(values)
        results: list[Any] = [None] * len(values)
        images, positions = [], []
        for i, value in enumerate(values):
            try:
                images.append(decode_image(self.payloads.value(value, "image")))
                positions.append(i)
            except (PayloadError, OSError, ValueError) as exc:
                results[i] = exc
        use_cls = level == "L0"
        started = time.perf_counter()
        try:
            if not self.models:
                self.loop.run_until_complete(self._connect())
            engine = OcrEngine(self._infer, self.characters,
                               OcrSettings(det_limit=self.settings.det_limit, rec_batch=self.settings.rec_batch))
            timings = Timings()
            read = self._read(engine, images, use_cls, timings)
        except (InferenceUnavailableError, ServiceUnavailableError) as exc:
            self.models.clear()
            raise BackpressureError(str(exc)) from exc
        elapsed = time.perf_counter() - started
        self._observe(timings, elapsed)
        skipped = [] if use_cls else [self.settings.low_priority_model]
        versions = {m: v for m, v in self.versions.items() if m not in skipped}
        for i, lines in zip(positions, read):
            value = values[i]
            if isinstance(lines, BaseException):
                results[i] = lines
                continue
            self._confidences.extend(l.confidence for l in lines)
            results[i] = {"doc_id": value["doc_id"], "device_id": value["device_id"], "uploaded_ms": value["uploaded_ms"],
                          "lines": [{"text": l.text, "confidence": l.confidence,
                                     "box": [c for point in l.box for c in point]} for l in lines],
                          "model_versions": versions, "skipped_models": skipped, "ocr_ms": elapsed * 1000,
                          "degradation_level": level, "image_phash": value["image_phash"]}
        if self._confidences:
            CONFIDENCE_P50.labels(self.name).set(float(np.median(self._confidences)))
        return results

    def _read(self, engine: OcrEngine, images: list[np.ndarray], use_cls: bool, timings: Timings) -> list[Any]:
        """Every document at once; when Triton refuses the batch, each on its own (only a bad one fails)."""
        assert self.loop is not None
        try:
            return self.loop.run_until_complete(engine.read(images, use_cls=use_cls, timings=timings))
        except InferenceUnavailableError:
            raise
        except InferenceError as exc:
            if "out of memory" in str(exc).lower():
                TRITON_OOM.labels(self.name).inc()
            if len(images) == 1:
                return [exc]
        out: list[Any] = []
        for image in images:
            try:
                out.extend(self.loop.run_until_complete(engine.read([image], use_cls=use_cls, timings=timings)))
            except InferenceUnavailableError:
                raise
            except InferenceError as exc:
                out.append(exc)
        return out

    def _observe(self, t: Timings, elapsed: float) -> None:
        self._latencies.append((time.monotonic(), elapsed * 1000))
        for step in ("pre", "det", "boxes", "cls", "rec", "decode"):
            OCR_SECONDS.labels(self.name, step).observe(getattr(t, step))
        OCR_SECONDS.labels(self.name, "total").observe(elapsed)

    def close(self) -> None:
        if self.config is not None:
            self.config.stop()
        if self.loop is not None:
            for model in self.models.values():
                self.loop.run_until_complete(model.close())
            self.loop.close()


class Extract(Stage):
    """OCR lines → fields and checks, by the declared extraction spec (the rules' "prediction")."""

    class Settings(StageSettings):
        spec: str = Field(description="The extraction spec (YAML), relative to the app folder.")
        model: str = Field(REC, description="The model the fields are read with (the predictions' model_name).")

    def __init__(self, ctx: BuildContext):
        super().__init__(ctx)
        self.spec = load_spec(ctx.path(self.settings.spec))

    def transform(self, value: dict, record: Record) -> dict:
        lines = [Line(l["text"], l["confidence"], tuple(zip(l["box"][0::2], l["box"][1::2]))) for l in value["lines"]]
        day = datetime.fromtimestamp(value["uploaded_ms"] / 1000, timezone.utc).date()
        e = extract(lines, self.spec, day)
        versions = value["model_versions"]
        return {"event_id": f"{self.name}:{value['doc_id']}", "doc_id": value["doc_id"], "device_id": value["device_id"],
                "uploaded_ms": value["uploaded_ms"], "doc_type": e.doc_type, "fields": e.fields,
                "confidences": e.confidences, "missing_fields": e.missing, "complete": e.complete,
                "code_valid": e.code_valid, "expired": e.expired, "min_confidence": e.min_confidence,
                "code_confidence": e.code_confidence, "label": e.doc_type, "score": e.min_confidence,
                "model_name": self.settings.model, "model_version": versions.get(self.settings.model, ""),
                "model_versions": versions, "inference_ms": value["ocr_ms"], "image_phash": value["image_phash"],
                "trace_id": record.header("trace_id")}


class GalleryWriter(Sink):
    """Approved documents → the gallery (Redis stream) that degradation L2 matches new uploads against.

    A re-delivered batch appends its documents again; readers index a document once (``Gallery.refresh``)."""

    services = frozenset({"redis", "registry"})

    class Settings(StageSettings):
        key_prefix: str | None = Field(None, description="Prefix of this app's Redis keys (as the intake's; default "
                                                         "the topology's app name).")
        max_entries: int = Field(100_000, ge=1, description="The gallery keeps the newest this many documents.")

    def __init__(self, ctx: BuildContext):
        super().__init__(ctx)
        self.redis, self.guard = _redis(ctx)
        self.gallery = Gallery(self.redis, f"{_key_prefix(ctx, self.settings.key_prefix)}:gallery",
                               self.settings.max_entries)

    def write(self, values: Sequence[dict], records: Sequence[Record]) -> None:
        for value in values:
            if value["model_versions"]:  # decided on OCR, not itself a gallery match
                _redis_call(self.guard, "adding to the gallery", lambda v=value: self.gallery.add(
                    v["doc_id"], v["image_phash"], v["doc_type"], v["fields"]))

    def close(self) -> None:
        self.redis.close()
