"""Inference workers (seed node 3): feature micro-batches → Triton → predictions.

One micro-batch from Kafka becomes one numpy matrix and one Triton call (Triton's
dynamic batcher merges calls from several workers). Rows that cannot be scored
(undecodable, non-finite features) go to the DLQ; if Triton itself fails, the
batch is retried with backoff and, past ``max_attempts``, the worker stops
without committing, so a restart scores the same records again: nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
from prometheus_client import Histogram
from pydantic import BaseModel, ConfigDict, Field

from inference_workers.triton_client import ModelContract, TensorContract, TritonModel
from streams.avro import AvroCodec, WireFormatError
from streams.context import BuildContext
from streams.delivery import H_EVENT_ID, Output, Processor, Record, carry_headers, dead_letter
from streams.errors import InferenceError
from streams.features import FEATURE_NAMES

log = logging.getLogger("tangram.inference")

TRITON_SECONDS = Histogram(
    "tangram_inference_triton_duration_seconds", "Triton round trip of one micro-batch.", ["model"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
BATCH_ROWS = Histogram(
    "tangram_inference_batch_rows", "Rows per Triton call.", ["model"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
)


class InferenceSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field("anomaly", description="Triton model name.")
    model_version: str = Field("1", description="Triton model version the worker calls.")
    classes: tuple[str, ...] = Field(("healthy", "bearing_wear", "overheating"), description="Output columns, in order.")
    healthy_class: str = Field("healthy", description="score = 1 - P(healthy_class).")
    timeout_s: float = Field(2.0, gt=0, description="Deadline of each Triton call.")
    max_attempts: int = Field(5, ge=1, description="Tries per batch before the worker gives up (without committing).")
    backoff_s: float = Field(0.5, gt=0, description="First retry delay; doubles each try.")


class InferenceWorker(Processor):
    """``DeviceWindow`` (Avro) → ``AnomalyPrediction`` (Avro) through Triton."""

    name = "inference"

    def __init__(self, *, input_codec: AvroCodec, output_codec: AvroCodec, output_topic: str, dlq_topic: str,
                 triton_url: str, settings: InferenceSettings):
        self.input_codec = input_codec
        self.output_codec = output_codec
        self.output_topic = output_topic
        self.dlq_topic = dlq_topic
        self.settings = settings
        contract = ModelContract(
            input=TensorContract("features", "FP32", (len(FEATURE_NAMES),)),
            output=TensorContract("probabilities", "FP32", (len(settings.classes),)),
        )
        self.model = TritonModel(triton_url, settings.model, settings.model_version, settings.timeout_s, contract)
        self.loop = asyncio.new_event_loop()

    @classmethod
    def build(cls, ctx: BuildContext) -> "InferenceWorker":
        (source,), (output,) = ctx.spec.inputs, ctx.spec.outputs
        return cls(input_codec=ctx.codec(source), output_codec=ctx.codec(output), output_topic=output,
                   dlq_topic=ctx.dlq, triton_url=ctx.stack.triton_grpc_url,
                   settings=InferenceSettings.model_validate(ctx.spec.params))

    def setup(self) -> None:
        self.loop.run_until_complete(self.model.setup())  # refuses to start on a contract mismatch

    def process(self, batch: list[Record]) -> list[Output]:
        outputs: list[Output] = []
        rows: list[tuple[Record, dict]] = []
        for record in batch:
            try:
                window = self.input_codec.decode(record.value)
            except WireFormatError as exc:
                outputs.append(dead_letter(record, self.dlq_topic, self.name, exc, "undecodable"))
                continue
            if not all(np.isfinite(window[name]) for name in FEATURE_NAMES):
                outputs.append(dead_letter(record, self.dlq_topic, self.name, "non-finite feature value", "bad_features"))
                continue
            rows.append((record, window))
        if not rows:
            return outputs
        matrix = np.array([[w[name] for name in FEATURE_NAMES] for _, w in rows], dtype=np.float32)
        probabilities, seconds = self._infer(matrix)
        s = self.settings
        healthy = s.classes.index(s.healthy_class)
        for (record, window), p in zip(rows, probabilities):
            k = int(np.argmax(p))
            device = window["device_id"]
            prediction = {
                "event_id": f"{s.model}:{s.model_version}:{device}:{window['window_start']}",
                "device_id": device,
                "window_start": window["window_start"],
                "window_end": window["window_end"],
                "score": float(1.0 - p[healthy]),
                "label": s.classes[k],
                "confidence": float(p[k]),
                "probabilities": {c: float(v) for c, v in zip(s.classes, p)},
                "model_name": s.model,
                "model_version": s.model_version,
                "inference_ms": seconds * 1000,
                "trace_id": record.header("trace_id"),
            }
            headers = carry_headers(record, **{H_EVENT_ID: prediction["event_id"]})
            outputs.append(Output(self.output_topic, device, self.output_codec.encode(prediction), headers))
        return outputs

    def _infer(self, matrix: np.ndarray) -> tuple[np.ndarray, float]:
        s = self.settings
        for attempt in range(1, s.max_attempts + 1):
            started = time.perf_counter()
            try:
                result = self.loop.run_until_complete(self.model.infer(matrix))
            except InferenceError as exc:
                if attempt == s.max_attempts:
                    raise
                delay = s.backoff_s * 2 ** (attempt - 1)
                log.warning("inference of %d rows failed (try %d/%d), retrying in %.1fs: %s",
                            len(matrix), attempt, s.max_attempts, delay, exc)
                time.sleep(delay)
                continue
            seconds = time.perf_counter() - started
            TRITON_SECONDS.labels(s.model).observe(seconds)
            BATCH_ROWS.labels(s.model).observe(len(matrix))
            return result, seconds
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.loop.run_until_complete(self.model.close())
        self.loop.close()
