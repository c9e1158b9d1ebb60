"""Inference workers (seed node 3): feature micro-batches → Triton → predictions.

What the worker reads and writes is declared, never assumed: the input columns that form the
model's input vector (``features``, or the order of a ``feature_set``), the model's input and output
tensors and its batching (the model's own ``config.pbtxt`` in the app's model repository, checked
against what Triton serves), the class labels (the output's ``label_filename`` there) and the output
contract (the predictions schema: every field it shares with the input schema is carried over, such
as the entity and window bounds; the rest are the prediction's own fields below).

One micro-batch from Kafka becomes one numpy matrix and one Triton call per model version it is
routed to (Triton's dynamic batcher merges calls from several workers); the calls of one batch
run concurrently, each with its deadline. What happens when something fails:

- a row that cannot be decoded or has non-finite features goes to the DLQ at once;
- Triton down, overloaded or past its deadline (:class:`~streams.errors.InferenceUnavailableError`):
  each call goes through the worker's Triton guard (:mod:`streams.resilience`: the topology's
  ``calls`` deadline, retries with jittered backoff, circuit breaker); when its tries are spent or
  the breaker is open the worker raises :class:`~streams.errors.BackpressureError`; the delivery
  loop pauses the partitions, keeps polling, backs off, asks :meth:`InferenceWorker.ready` (no call
  to Triton while the breaker is open), resumes and retries the same records. Nothing is produced
  or committed meanwhile, so nothing is lost;
- Triton answers but refuses the batch while the model is ready: the batch is bisected to find
  the rows it refuses; such a row is retried with the batch (backpressure) and, on its
  ``max_row_attempts``-th failure, goes to the DLQ with reason ``inference_refused``.

Routing (:mod:`inference_workers.routing`): production and challenger side by side, a canary
share by a stable hash of the key, or shadow mode where the challenger scores a copy whose
predictions go to ``shadow_topic`` and are never acted on. Every prediction names the model and
version that produced it. The routing can change without a restart (``routing_file``, the model
registry) with Triton's explicit model control (:mod:`inference_workers.serving`): Triton loads the new
versions beside the served ones, they are contract-checked, the switch happens between two batches, then
Triton unloads the versions no longer routed. A replica still calling an unloaded version gets
"unavailable": backpressure, never loss.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ConfigDict, Field, model_validator

from inference_workers.routing import (
    ModelTarget,
    RoutingFile,
    RoutingPlan,
    RoutingSettings,
    VersionRouting,
)
from inference_workers.serving import ModelServing
from inference_workers.triton_client import ModelContract, ModelRepository, TritonModel
from streams.avro import AvroCodec
from streams.wire import WireFormatError
from streams.columnar import MapColumn
from streams.context import BuildContext
from streams.delivery import (
    H_EVENT_ID,
    H_TRACE_ID,
    Output,
    Processor,
    Record,
    carry_headers,
    dead_letter,
)
from streams.errors import (
    BackpressureError,
    InferenceError,
    InferenceUnavailableError,
    ServiceUnavailableError,
    TopologyError,
)
from streams.config_center import CONFIG_TOPIC, ConfigSubscriber
from streams.features.spec import load_feature_set
from streams.lifecycle import MODELS_TOPIC
from streams.resilience import Guard
from streams.security.kafka import KafkaConnection
from streams.statelog import StateTopic

log = logging.getLogger("tangram.inference")
T = TypeVar("T")

TRITON_SECONDS = Histogram(
    "tangram_inference_triton_duration_seconds", "Triton round trip of one call.", ["model", "version"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
BATCH_ROWS = Histogram(
    "tangram_inference_batch_rows", "Rows per Triton call.", ["model", "version"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
)
QUEUE_WAIT = Histogram(
    "tangram_inference_queue_wait_seconds",
    "Age of the oldest record of a micro-batch when it is scored (Kafka append time to Triton call).",
    ["processor"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
ROWS = Counter(
    "tangram_inference_rows_total", "Rows scored (rate() gives rows/s), by version and route.",
    ["model", "version", "route"],
)
ERRORS = Counter(
    "tangram_inference_errors_total", "Failed Triton calls and refused rows, by kind.", ["model", "version", "kind"]
)

#: Route labels of a prediction: acted on (production, canary) or not (shadow).
ROUTE_PRODUCTION, ROUTE_CANARY, ROUTE_SHADOW = "production", "canary", "shadow"
#: The fields of a prediction the worker writes itself; every other field of the predictions schema is carried
#: over from the input record (the entity, the window bounds, ...).
PREDICTION_FIELDS = ("event_id", "score", "label", "confidence", "probabilities", "model_name", "model_version",
                     "inference_ms", "trace_id")


class InferenceSettings(BaseModel):
    """The ``params`` of an inference processor in a topology."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="Triton model name: a folder of the app's model repository.")
    model_version: str = Field("1", description="Production version when `routing` is not given.")
    features: tuple[str, ...] | None = Field(None, description="The input fields that form the model's input vector, "
                                                               "in order (or give `feature_set`).")
    feature_set: str | None = Field(None, description="A feature-set declaration whose feature order is the input "
                                                      "vector (relative to the app folder).")
    negative_class: str | None = Field(None, description="score = 1 - P(negative_class) (e.g. `healthy`); "
                                                         "none: score = the top class's probability.")
    timeout_s: float = Field(2.0, gt=0, description="Deadline of each Triton call.")
    load_timeout_s: float = Field(60.0, gt=0, description="Deadline of loading a model version into Triton "
                                                          "(explicit model control) when the routing needs it.")
    max_row_attempts: int = Field(3, ge=1, description="Tries of a row Triton refuses before it goes to the DLQ.")
    routing: RoutingSettings | None = Field(None, description="Production/challenger versions, canary or shadow.")
    routing_file: str | None = Field(None, description="JSON RoutingSettings re-read on change (switch without restart).")
    follow_registry: bool = Field(False, description="Take production, challenger, canary share and shadow from the "
                                                     "model registry (`_tangram.models`), live; artifacts are checked "
                                                     "against their registered sha256 before a switch.")
    registry_topic: str = Field(MODELS_TOPIC, description="The model registry's compacted topic.")
    follow_degradation: bool = Field(False, description="Follow the config center's `feature-switch/degradation.level`: "
                                                        "at L1 and above the challenger (canary or shadow) is off.")
    config_topic: str = Field(CONFIG_TOPIC, description="The config center's compacted topic.")
    shadow_topic: str | None = Field(None, description="Where shadow predictions go; one of the processor's outputs.")

    @model_validator(mode="after")
    def _one_feature_source(self) -> "InferenceSettings":
        if (self.features is None) == (self.feature_set is None):
            raise ValueError("give exactly one of `features` (a list of input fields) and `feature_set`")
        return self

    def initial_routing(self) -> RoutingSettings:
        return self.routing or RoutingSettings(production=self.model_version)


@dataclasses.dataclass(frozen=True)
class _Group:
    """Rows of one batch sent to one model version."""

    target: ModelTarget
    rows: np.ndarray  # indices into the batch's scoreable rows
    route: str


@dataclasses.dataclass(frozen=True)
class _Rows:
    """A batch's inputs as columns (row i of each belongs to record i): entities, carried fields, the matrix."""

    keys: list[str]
    carried: dict[str, Any]  # output field → column taken from the input
    matrix: np.ndarray  # rows × features, the model's input dtype

    def take(self, rows: np.ndarray) -> "_Rows":
        picked = rows.tolist()
        return _Rows([self.keys[i] for i in picked],
                     {name: _take(column, rows, picked) for name, column in self.carried.items()}, self.matrix[rows])


def _take(column: Any, rows: np.ndarray, picked: list[int]) -> Any:
    return column[rows] if isinstance(column, np.ndarray) else [column[i] for i in picked]


class InferenceWorker(Processor):
    """Input records (Avro) → one prediction each (Avro) through Triton, as the topology declares."""

    name = "inference"
    pipelined = True  # a batch's Triton calls overlap the delivery of the batch before
    services = frozenset({"triton", "registry"})
    needs_models = True  # following the registry, it checks each artifact's digest before a switch

    def __init__(self, *, input_codec: AvroCodec, output_codec: AvroCodec, output_topic: str, dlq_topic: str,
                 triton_url: str, settings: InferenceSettings, contract: ModelContract, features: Sequence[str],
                 shadow_topic: str | None = None, kafka: KafkaConnection | None = None,
                 model_repository: Path | None = None, triton_key: str | None = None,
                 triton_guard: Guard | None = None, models_per_server: int | None = None):
        self.input_codec = input_codec
        self.output_codec = output_codec
        self.input_batch = input_codec.batch
        if output_codec.batch is None:
            raise TopologyError(f"{self.name}: the predictions schema {output_codec.subject!r} is not a flat record")
        self.output_batch = output_codec.batch
        self.output_topic = output_topic
        self.shadow_topic = shadow_topic
        self.dlq_topic = dlq_topic
        self.settings = settings
        #: the topology's Triton calls (deadline, retries, breaker); the deadline is the declared one when given
        self.triton_guard = triton_guard
        self.timeout_s = triton_guard.timeout_s if triton_guard is not None else settings.timeout_s
        self.contract = contract
        self.features = tuple(features)
        if contract.input.dims != (len(self.features),):
            raise TopologyError(f"{self.name}: model {settings.model!r} takes input {contract.input.name!r} of dims "
                                f"{list(contract.input.dims)}, the processor declares {len(self.features)} features")
        self.classes = contract.labels
        if len(self.classes) != contract.output.dims[-1]:
            raise TopologyError(f"{self.name}: model {settings.model!r} has {contract.output.dims[-1]} outputs and "
                                f"{len(self.classes)} labels ({contract.output.name!r}'s label_filename)")
        if settings.negative_class is not None and settings.negative_class not in self.classes:
            raise TopologyError(f"{self.name}: negative_class {settings.negative_class!r} is not a label of model "
                                f"{settings.model!r} ({', '.join(self.classes)})")
        input_fields = {f["name"] for f in input_codec.schema_json["fields"]}
        output_fields = [f["name"] for f in output_codec.schema_json["fields"]]
        self.carried = [f for f in output_fields if f not in PREDICTION_FIELDS]
        missing = [f for f in (*self.carried, *self.features) if f not in input_fields]
        if missing:
            raise TopologyError(f"{self.name}: the input schema {input_codec.subject!r} lacks {missing}, which the "
                                f"model's features or the predictions schema {output_codec.subject!r} need")
        self.config: ConfigSubscriber | None = None
        self.row_failures: dict[tuple[str, int, int], int] = {}
        # Triton calls run on an event loop of their own thread, so that a batch's calls are in flight while
        # the delivery loop waits for the acks of the batch before (``pipelined``).
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name=f"{self.name}-triton", daemon=True)
        self._loop_thread.start()
        self._triton_turn = asyncio.Lock()
        self._in_flight: concurrent.futures.Future | None = None  # the Triton calls of the newest batch submitted
        self.kafka = kafka
        self.serving = ModelServing(
            self.name, settings.model, VersionRouting(settings.initial_routing(), settings.model),
            ModelRepository(triton_url, self.timeout_s, settings.load_timeout_s, control_key=triton_key),
            lambda target: TritonModel(triton_url, target.model, target.version, self.timeout_s, contract=contract),
            self._run, routing_file=RoutingFile(settings.routing_file) if settings.routing_file else None,
            registry_topic=settings.registry_topic if settings.follow_registry else None, kafka=kafka,
            model_repository=model_repository, models_per_server=models_per_server, shadow_topic=shadow_topic)

    @classmethod
    def build(cls, ctx: BuildContext) -> "InferenceWorker":
        settings = ctx.settings(InferenceSettings)
        (source,) = ctx.spec.inputs
        outputs = list(ctx.spec.outputs)
        if settings.shadow_topic is not None:
            if settings.shadow_topic not in outputs:
                raise TopologyError(f"processor {ctx.name!r}: shadow_topic {settings.shadow_topic!r} "
                                    f"must be one of its outputs {outputs}")
            outputs.remove(settings.shadow_topic)
        if len(outputs) != 1:
            raise TopologyError(f"processor {ctx.name!r}: expected one predictions output besides the shadow topic, "
                                f"got {outputs}")
        features = settings.features or load_feature_set(ctx.path(settings.feature_set)).feature_names
        contract = ModelContract.from_config(ctx.topology.model_repository / settings.model)
        guard = ctx.calls.guard("triton", (InferenceUnavailableError,))
        if "triton" in ctx.calls.declared and "timeout_s" in settings.model_fields_set \
                and abs(settings.timeout_s - guard.timeout_s) > 1e-9:
            raise TopologyError(f"processor {ctx.name!r}: params.timeout_s {settings.timeout_s:g} s and its declared "
                                f"triton call's timeout_ms {guard.call_spec.timeout_ms} disagree; keep one "
                                "(the `calls:` declaration is the deadline)")
        return cls(input_codec=ctx.codec(source), output_codec=ctx.codec(outputs[0]), output_topic=outputs[0],
                   dlq_topic=ctx.dlq, triton_url=ctx.stack.triton_grpc_url, settings=settings, contract=contract,
                   features=features, shadow_topic=settings.shadow_topic,
                   kafka=ctx.stack.kafka, model_repository=ctx.stack.model_repository,
                   triton_key=ctx.stack.triton_key, triton_guard=guard,
                   models_per_server=ctx.spec.state.models_per_server)

    # -- lifecycle -------------------------------------------------------------------
    def setup(self) -> None:
        """Follow the config center's degradation level when asked, then have Triton serve every routed version
        (:meth:`ModelServing.start`); refuses to start on a contract mismatch or a version Triton cannot load."""
        if self.settings.follow_degradation:
            StateTopic(self.kafka, self.settings.config_topic).ensure()  # a fresh stack has none yet
            self.config = ConfigSubscriber(self.kafka, self.settings.config_topic, name=self.name,
                                           namespaces=["feature-switch"]).start()
        self.serving.start()

    def _refresh_routing(self) -> None:
        """Switch to a new routing, if any, between two batches, once the batch submitted before has its answers."""
        self.serving.refresh(self._drain)

    def _drain(self) -> None:
        if self._in_flight is not None:
            concurrent.futures.wait([self._in_flight])

    def degradation_level(self) -> str:
        """The config center's manual degradation level, when this worker follows it; L0 otherwise."""
        return str(self.config.get("feature-switch", "degradation.level", "L0")) if self.config else "L0"

    def _effective_plan(self) -> RoutingPlan:
        """The routing for this batch: at degradation L1 and above only production scores (seed: L1 = challenger off)."""
        plan = self.serving.plan
        if plan.challenger is not None and self.degradation_level() != "L0":
            return dataclasses.replace(plan, challenger=None)
        return plan

    def ready(self) -> bool:
        """True when Triton answers and every routed version is ready (each probe has the call deadline).

        A routing change waiting meanwhile is applied first (the batch was put back); a routed version Triton
        no longer serves is loaded again (:meth:`ModelServing.ready`).
        """
        self._refresh_routing()
        if self.triton_guard is not None and not self.triton_guard.available():
            log.info("%s: not ready: the Triton circuit breaker is open (%s)", self.name, self.triton_guard.state)
            return False
        return self._run(self.serving.ready())

    def idle(self) -> list[Output]:
        self._refresh_routing()
        return []

    def close(self) -> None:
        if self.config is not None:
            self.config.stop()
        self.serving.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(10)
        self.loop.close()

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        """Run ``call`` on the worker's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(call, self.loop).result()

    # -- the work ----------------------------------------------------------------------
    def process(self, batch: list[Record]) -> list[Output]:
        return self.submit(batch)()

    def submit(self, batch: list[Record]) -> Callable[[], list[Output]]:
        """Decode ``batch`` and send its Triton calls; what this returns waits for them and builds the predictions."""
        self._refresh_routing()
        outputs: list[Output] = []
        records, rows = self._rows(batch, outputs)
        if rows is None:
            return lambda: outputs
        finite = np.isfinite(rows.matrix).all(axis=1)
        if not finite.all():
            outputs.extend(dead_letter(records[i], self.dlq_topic, self.name, "non-finite feature value", "bad_features")
                           for i in np.flatnonzero(~finite))
            keep = np.flatnonzero(finite)
            records, rows = [records[i] for i in keep], rows.take(keep)
            if not records:
                return lambda: outputs
        QUEUE_WAIT.labels(self.name).observe(max(0.0, time.time() - min(r.timestamp_ms for r in records) / 1000))
        groups = self._groups(self._effective_plan(), rows.keys)
        matrix = rows.matrix

        async def score_all() -> list:
            async with self._triton_turn:  # one batch's calls at a time, in order: the next goes out as these answer
                return await asyncio.gather(*(self._score(g.target, matrix[g.rows]) for g in groups),
                                            return_exceptions=True)

        calls = self._in_flight = asyncio.run_coroutine_threadsafe(score_all(), self.loop)
        return functools.partial(self._finish, records, rows, groups, calls, outputs)

    def _finish(self, records: list[Record], rows: _Rows, groups: list[_Group],
                calls: concurrent.futures.Future, outputs: list[Output]) -> list[Output]:
        """The batch's predictions (and dead letters) once its Triton calls answered; BackpressureError when
        Triton is unavailable or refused rows that have tries left."""
        results = calls.result()
        refused: list[tuple[int, InferenceError]] = []
        scored: list[tuple[_Group, np.ndarray, dict[int, InferenceError], float]] = []
        for group, result in zip(groups, results):
            if isinstance(result, BaseException):
                if group.route == ROUTE_SHADOW and isinstance(result, InferenceError):
                    log.warning("%s: shadow %s skipped for %d rows: %s", self.name, group.target, len(group.rows), result)
                    continue  # shadow outputs are never acted on: they never hold production back
                if isinstance(result, InferenceUnavailableError):
                    raise BackpressureError(f"{self.name}: {result}") from result
                raise result
            probabilities, bad, seconds = result
            scored.append((group, probabilities, bad, seconds))
            if group.route != ROUTE_SHADOW:
                refused.extend((int(group.rows[i]), exc) for i, exc in bad.items())
        dead = self._refused_rows(records, refused)
        outputs.extend(dead_letter(records[i], self.dlq_topic, self.name, exc, "inference_refused")
                       for i, exc in dead.items())
        for group, probabilities, bad, seconds in scored:
            topic = self.shadow_topic if group.route == ROUTE_SHADOW else self.output_topic
            kept = np.ones(len(group.rows), dtype=bool)
            kept[list(bad)] = False
            picked = group.rows[kept]
            outputs.extend(self._predictions([records[i] for i in picked.tolist()], rows.take(picked),
                                             probabilities[kept], group.target, seconds, topic))
            ROWS.labels(group.target.model, group.target.version, group.route).inc(len(picked))
        return outputs

    def _rows(self, batch: list[Record], outputs: list[Output]) -> tuple[list[Record], _Rows | None]:
        """The batch's inputs as columns: the whole batch at once when every value reads cleanly in the
        contract's schema, else record by record (undecodable ones to the DLQ)."""
        columns = self.input_batch.decode([r.value for r in batch]) if self.input_batch is not None else None
        records = batch
        if columns is None:
            records, decoded = [], []
            for record in batch:
                try:
                    decoded.append(self.input_codec.decode(record.value))
                except WireFormatError as exc:
                    outputs.append(dead_letter(record, self.dlq_topic, self.name, exc, "undecodable"))
                    continue
                records.append(record)
            if not records:
                return records, None
            columns = {name: [value[name] for value in decoded] for name in (*self.carried, *self.features)}
        dtype = self.contract.input.numpy_dtype
        matrix = np.column_stack([np.asarray(columns[name], dtype=dtype) for name in self.features])
        keys = [r.key.decode("utf-8", "replace") if r.key is not None else "" for r in records]
        return records, _Rows(keys, {name: columns[name] for name in self.carried}, matrix)

    def _groups(self, plan: RoutingPlan, keys: Sequence[str]) -> list[_Group]:
        everyone = np.arange(len(keys))
        if plan.challenger is None:
            return [_Group(plan.production, everyone, ROUTE_PRODUCTION)]
        if plan.shadow:
            return [_Group(plan.production, everyone, ROUTE_PRODUCTION), _Group(plan.challenger, everyone, ROUTE_SHADOW)]
        canary = plan.canary_mask(keys)
        groups = [_Group(plan.production, everyone[~canary], ROUTE_PRODUCTION),
                  _Group(plan.challenger, everyone[canary], ROUTE_CANARY)]
        return [g for g in groups if len(g.rows)]

    def _refused_rows(self, records: list[Record], refused: list[tuple[int, InferenceError]]) -> dict[int, InferenceError]:
        """Count each refusal; rows refused ``max_row_attempts`` times are returned (for the DLQ).

        Rows refused fewer times hold the batch back: it is retried after a backoff.
        """
        if not refused:
            return {}
        limit = self.settings.max_row_attempts
        retry: list[str] = []
        for i, _ in refused:
            record = records[i]
            key = (record.topic, record.partition, record.offset)
            tries = self.row_failures[key] = self.row_failures.get(key, 0) + 1
            if tries < limit:
                retry.append(f"{record.where} (try {tries}/{limit})")
        if retry:
            raise BackpressureError(f"{self.name}: Triton refused rows {', '.join(retry[:5])}; the batch is retried")
        dead: dict[int, InferenceError] = {}
        for i, exc in refused:
            record = records[i]
            self.row_failures.pop((record.topic, record.partition, record.offset), None)
            dead[i] = exc
            log.error("%s: %s refused by Triton %d times, to the DLQ: %s", self.name, record.where, limit, exc)
        return dead

    async def _score(self, target: ModelTarget, matrix: np.ndarray) -> tuple[np.ndarray, dict[int, InferenceError], float]:
        """Probabilities for ``matrix`` (rows Triton refuses are zero and listed with their error), and seconds."""
        model = await self.serving.client_of(target)
        started = time.perf_counter()
        try:
            probabilities = await self._call(model, target, matrix)
            return probabilities, {}, time.perf_counter() - started
        except InferenceUnavailableError:
            raise
        except InferenceError as exc:
            if not await model.is_ready():
                raise InferenceUnavailableError(f"{target} is not ready: {exc}") from exc
            first_error = exc
        # Triton is up and refuses this batch: find the rows it refuses by bisection.
        probabilities = np.zeros((len(matrix), len(self.classes)), dtype=self.contract.output.numpy_dtype)
        bad: dict[int, InferenceError] = {}

        async def bisect(lo: int, hi: int, known: InferenceError | None) -> None:
            error = known
            if error is None:
                try:
                    probabilities[lo:hi] = await self._call(model, target, matrix[lo:hi])
                    return
                except InferenceUnavailableError:
                    raise
                except InferenceError as exc:
                    error = exc
            if hi - lo == 1:
                ERRORS.labels(target.model, target.version, "refused_row").inc()
                bad[lo] = error
                return
            mid = (lo + hi) // 2
            await bisect(lo, mid, None)
            await bisect(mid, hi, None)

        await bisect(0, len(matrix), first_error)
        return probabilities, bad, time.perf_counter() - started

    async def _call(self, model: TritonModel, target: ModelTarget, matrix: np.ndarray) -> np.ndarray:
        started = time.perf_counter()
        try:
            if self.triton_guard is None:
                result = await model.infer(matrix)
            else:
                try:
                    result = await self.triton_guard.acall(model.infer, matrix)
                except ServiceUnavailableError as exc:  # tries spent or breaker open: Triton is unavailable
                    raise InferenceUnavailableError(str(exc)) from exc
        except InferenceUnavailableError:
            ERRORS.labels(target.model, target.version, "unavailable").inc()
            raise
        except InferenceError:
            ERRORS.labels(target.model, target.version, "refused").inc()
            raise
        TRITON_SECONDS.labels(target.model, target.version).observe(time.perf_counter() - started)
        BATCH_ROWS.labels(target.model, target.version).observe(len(matrix))
        return result

    def _predictions(self, records: list[Record], rows: _Rows, probabilities: np.ndarray,
                     target: ModelTarget, seconds: float, topic: str) -> list[Output]:
        """One prediction per row, computed column-wise and encoded as one batch.

        Its ``event_id`` is the model version's and the input's (``anomaly:1:<input event id>``): the same
        input scored by the same version always gives the same id, so replays and subscribers deduplicate."""
        s, n = self.settings, len(records)
        if n == 0:
            return []
        classes = self.classes
        labels = np.asarray(classes, dtype=object)[probabilities.argmax(axis=1)].tolist()
        confidence = probabilities.max(axis=1)
        prefix = f"{target.model}:{target.version}:"
        event_ids = [prefix + (r.header(H_EVENT_ID) or r.where) for r in records]
        values = self.output_batch.encode({
            **rows.carried,
            "event_id": event_ids,
            "score": confidence if s.negative_class is None else 1.0 - probabilities[:, classes.index(s.negative_class)],
            "label": labels,
            "confidence": confidence,
            "probabilities": MapColumn(classes, probabilities),
            "model_name": [target.model] * n,
            "model_version": [target.version] * n,
            "inference_ms": np.full(n, seconds * 1000),
            "trace_id": [r.header(H_TRACE_ID) for r in records],
        }, n)
        return [Output(topic, record.key, value, carry_headers(record, **{H_EVENT_ID: event_id}))
                for record, value, event_id in zip(records, values, event_ids)]
