"""Inference benchmark: the worker (Kafka in → Triton → predictions out) against its baselines, in one run.

For each batch size of the sweep, the same feature rows go through three paths:

1. **worker**: DeviceWindow records on a Kafka topic, consumed by the real ``InferenceWorker`` inside
   the real delivery loop (``streams.delivery.Runner``, at-least-once): decode, one Triton call per
   micro-batch, encode, produce, wait for the broker's acks, commit;
2. **triton**: the same matrices sent to the same Triton with tritonclient's gRPC client, one call
   per batch, one after the other (what the worker does for its Triton call, without Kafka);
3. **onnxruntime**: the same matrices through an onnxruntime session of the same ONNX file, in
   this process (no server at all);
4. **kafka**: the same records copied by the raw confluent-kafka loop (consume, produce unchanged,
   acks, commit; ``baselines.raw_copy_seconds``) at the same batch size: what Kafka alone allows
   on this machine, with no decoding, no model and no encoding;
5. **hand-written**: the worker's whole job written directly, as a user would without Tangram:
   confluent-kafka, fastavro and tritonclient in one loop (consume a batch, decode each window, one
   Triton call, one prediction record each with the worker's fields, produce, wait for the acks,
   commit), one batch at a time. The same work as the worker, so the fair "direct Triton" baseline
   once Kafka is in the path; (2) alone is what the Triton call costs.

The worker is pipelined: the Triton call of one batch is in flight while the batch before is
encoded, produced and acknowledged and the batch after is fetched and decoded (one batch's call at a
time, like the direct client), so its ceiling is the slower of Triton and Kafka. It prints rows/s for
each path, the worker's ratio to Triton, to onnxruntime and to that ceiling (the lower of the
triton and kafka rates), and per-batch latency p50/p99 (worker: from ``submit()`` to the broker
acknowledging the batch's predictions; triton and onnxruntime: one call). It needs a running stack (``tangram up``; every address comes
from the ``TANGRAM_*`` settings) and creates its own topics. Not a test: figures, not assertions::

    .venv/bin/python benchmarks/bench_inference.py --sizes 1,16,64,256,1024 --exactly-once 256
"""

from __future__ import annotations

import argparse
import collections
import io
import math
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import fastavro
import numpy as np
import onnxruntime as ort
import tritonclient.grpc as grpcclient
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from inference_workers.triton_client import ModelContract  # noqa: E402
from inference_workers.worker import InferenceSettings, InferenceWorker  # noqa: E402
from streams.avro import codec  # noqa: E402
from baselines import raw_copy_seconds  # noqa: E402
from streams.delivery import Output, Processor, Record, Runner, RunnerConfig  # noqa: E402
from reference_app import APP, FEATURE_NAMES, FEATURE_SET  # noqa: E402
from streams.settings import StackSettings  # noqa: E402
from reference_app import load_schema  # noqa: E402
from report import Figure, commit, emit, load  # noqa: E402

WINDOW_SUBJECT, PREDICTION_SUBJECT = "pm.features.device_window-value", "pm.predictions.anomaly-value"


@dataclass
class Result:
    rows: int
    seconds: float
    latencies_s: list[float]

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q)) * 1000 if self.latencies_s else math.nan


class Timed(Processor):
    """Wraps the worker: times each batch from submit() to the flush() after its outputs were acknowledged
    (exactly-once: its transaction's); stops at ``rows``."""

    pipelined = True

    @classmethod
    def build(cls, ctx):
        raise TypeError("a benchmark wrapper, made around a built worker")

    def __init__(self, inner: InferenceWorker, rows: int):
        self.inner, self.rows, self.name = inner, rows, inner.name
        self.done = 0
        self.first_started: float | None = None
        self.last_flushed = 0.0
        self.latencies: list[float] = []
        self._started: collections.deque[float] = collections.deque()
        self.runner: Runner | None = None

    def setup(self) -> None:
        self.inner.setup()

    def process(self, batch: list[Record]) -> list[Output]:
        return self.submit(batch)()

    def submit(self, batch: list[Record]) -> Callable[[], list[Output]]:
        started = time.perf_counter()
        if self.first_started is None:
            self.first_started = started
        finish = self.inner.submit(batch)

        def timed() -> list[Output]:
            outputs = finish()  # raises BackpressureError before the batch counts
            self._started.append(started)
            self.done += len(batch)
            return outputs
        return timed

    def flush(self) -> None:  # once per delivery (its batches; exactly-once: its transaction)
        self.last_flushed = time.perf_counter()
        while self._started:
            self.latencies.append(self.last_flushed - self._started.popleft())
        if self.done >= self.rows and self.runner is not None:
            self.runner.stop()

    def ready(self) -> bool:
        return self.inner.ready()

    def close(self) -> None:
        self.inner.close()


def feature_rows(n: int, seed: int = 1) -> np.ndarray:
    """Plausible window features (healthy machines around their operating point), joined with the feature set's
    attribute defaults (this benchmark's devices are in no register)."""
    rng = np.random.default_rng(seed)
    means = {"temperature": 60.0, "vibration": 2.0, "current": 12.0, "pressure": 5.0, "rpm": 1500.0}
    columns = []
    for name in FEATURE_SET.aggregate_names:
        sensor, _, stat = name.partition("_")
        base = means.get(sensor, 0.1)
        scale = {"mean": 1.0, "min": 0.9, "max": 1.1, "std": 0.02, "ptp": 0.1}.get(stat, 1.0)
        columns.append(np.abs(rng.normal(base * scale, base * 0.02 + 1e-3, n)))
    columns += [np.full(n, value) for value in FEATURE_SET.enrichment.encode(None)]
    matrix = np.stack(columns, axis=1).astype(np.float32)
    matrix[:, FEATURE_NAMES.index("missing_rate")] = 0.0
    matrix[:, FEATURE_NAMES.index("vibration_band_energy")] = rng.uniform(0.05, 0.2, n)
    return matrix


def produce(stack: StackSettings, topic: str, matrix: np.ndarray) -> None:
    encode = codec(stack.registry_url, WINDOW_SUBJECT, load_schema(WINDOW_SUBJECT), register=True).encode
    producer = Producer({"bootstrap.servers": stack.bootstrap_servers, "enable.idempotence": True, "linger.ms": 20,
                         "compression.type": "lz4"})
    for i, row in enumerate(matrix):
        device = f"dev-{i % 500:04d}"
        window = {"device_id": device, "window_start": i * 5000, "window_end": i * 5000 + 5000, "count": 50,
                  **{name: float(v) for name, v in zip(FEATURE_NAMES, row)}}
        while True:
            try:
                producer.produce(topic, encode(window), device, headers={"event_id": f"{device}:{i}"})
                break
            except BufferError:
                producer.poll(0.1)
    assert producer.flush(60) == 0, "benchmark input not acknowledged"


def run_worker(stack: StackSettings, topics: dict[str, str], size: int, rows: int, model: str, version: str,
               exactly_once: bool = False) -> Result:
    worker = InferenceWorker(
        input_codec=codec(stack.registry_url, WINDOW_SUBJECT, load_schema(WINDOW_SUBJECT)),
        output_codec=codec(stack.registry_url, PREDICTION_SUBJECT, load_schema(PREDICTION_SUBJECT), register=True),
        output_topic=topics["out"], dlq_topic=topics["dlq"], triton_url=stack.triton_grpc_url,
        settings=InferenceSettings(model=model, model_version=version, timeout_s=10.0, features=FEATURE_NAMES,
                                   negative_class="healthy"),
        contract=ModelContract.from_config(APP / "model_repository" / model), features=FEATURE_NAMES,
    )
    timed = Timed(worker, rows)
    runner = Runner(timed, RunnerConfig(kafka=stack.kafka, group_id=f"bench-{uuid.uuid4().hex}",
                                        inputs=(topics["in"],), batch_size=size, max_wait_ms=500,
                                        exactly_once=exactly_once))
    runner.freeze_heap = True  # the stage timed as `tangram run` runs it
    timed.runner = runner
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    thread.join(600)
    if thread.is_alive():
        runner.stop()
        thread.join(60)
        raise RuntimeError(f"worker did not finish {rows} rows at batch size {size} within 600 s")
    assert timed.first_started is not None
    return Result(timed.done, timed.last_flushed - timed.first_started, timed.latencies)


def run_hand_written(stack: StackSettings, topics: dict[str, str], size: int, rows: int, model: str,
                     version: str) -> Result:
    """The worker's job in one hand-written loop (path 5 of the module's doc); latency from consume to commit."""
    out = codec(stack.registry_url, PREDICTION_SUBJECT, load_schema(PREDICTION_SUBJECT), register=True)
    window_schema = fastavro.parse_schema(load_schema(WINDOW_SUBJECT))
    prediction_schema = fastavro.parse_schema(load_schema(PREDICTION_SUBJECT))
    classes = list(ModelContract.from_config(APP / "model_repository" / model).labels)
    healthy = classes.index("healthy")
    consumer = Consumer(stack.kafka.config({"group.id": f"bench-hand-{uuid.uuid4().hex}", "enable.auto.commit": False,
                                            "auto.offset.reset": "earliest", "isolation.level": "read_committed"}))
    producer = Producer(stack.kafka.config({"enable.idempotence": True, "acks": "all", "linger.ms": 0.5,
                                            "compression.type": "lz4"}))
    client = grpcclient.InferenceServerClient(stack.triton_grpc_url)
    consumer.subscribe([topics["in"]])
    done, started, latencies = 0, None, []
    try:
        while done < rows:
            messages = [m for m in consumer.consume(size, 0.5) if m.error() is None]
            if not messages:
                continue
            t0 = time.perf_counter()
            started = started or t0
            windows = [fastavro.schemaless_reader(io.BytesIO(m.value()[5:]), window_schema) for m in messages]
            matrix = np.array([[w[name] for name in FEATURE_NAMES] for w in windows], dtype=np.float32)
            probabilities = _infer(client, matrix, model, version)
            seconds = time.perf_counter() - t0
            for m, w, p in zip(messages, windows, probabilities.tolist()):
                best = max(range(len(classes)), key=p.__getitem__)
                event_id = f"{model}:{version}:{dict(m.headers() or [])['event_id'].decode()}"
                prediction = {"event_id": event_id, "device_id": w["device_id"], "window_start": w["window_start"],
                              "window_end": w["window_end"], "score": 1.0 - p[healthy], "label": classes[best],
                              "confidence": p[best], "probabilities": dict(zip(classes, p)), "model_name": model,
                              "model_version": version, "inference_ms": seconds * 1000, "trace_id": ""}
                buffer = io.BytesIO()
                buffer.write(out.header)
                fastavro.schemaless_writer(buffer, prediction_schema, prediction)
                producer.produce(topics["hand"], buffer.getvalue(), m.key(), headers={"event_id": event_id})
            assert producer.flush(30) == 0, "hand-written loop: predictions not acknowledged"
            consumer.commit(asynchronous=True)  # after the acks, like the delivery loop
            done += len(messages)
            latencies.append(time.perf_counter() - t0)
        return Result(done, time.perf_counter() - started, latencies)
    finally:
        consumer.close()
        client.close()


def run_triton(stack: StackSettings, batches: list[np.ndarray], model: str, version: str) -> Result:
    client = grpcclient.InferenceServerClient(stack.triton_grpc_url)
    latencies = []
    try:
        for batch in batches[:2]:  # warm-up
            _infer(client, batch, model, version)
        started = time.perf_counter()
        for batch in batches:
            t0 = time.perf_counter()
            _infer(client, batch, model, version)
            latencies.append(time.perf_counter() - t0)
        return Result(sum(len(b) for b in batches), time.perf_counter() - started, latencies)
    finally:
        client.close()


def _infer(client: grpcclient.InferenceServerClient, batch: np.ndarray, model: str, version: str) -> np.ndarray:
    tensor = grpcclient.InferInput("features", list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch)
    result = client.infer(model, [tensor], model_version=version,
                          outputs=[grpcclient.InferRequestedOutput("probabilities")], client_timeout=10.0)
    return result.as_numpy("probabilities")


def run_onnxruntime(model_path: Path, batches: list[np.ndarray]) -> Result:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # as the local Triton runs it
    session = ort.InferenceSession(str(model_path), sess_options=options, providers=["CPUExecutionProvider"])
    for batch in batches[:2]:
        session.run(["probabilities"], {"features": batch})
    latencies = []
    started = time.perf_counter()
    for batch in batches:
        t0 = time.perf_counter()
        session.run(["probabilities"], {"features": batch})
        latencies.append(time.perf_counter() - t0)
    return Result(sum(len(b) for b in batches), time.perf_counter() - started, latencies)


def create_topics(stack: StackSettings, prefix: str) -> dict[str, str]:
    topics = {"in": f"{prefix}.features.device_window", "out": f"{prefix}.predictions.anomaly",
              "dlq": f"{prefix}.dlq.inference", "raw": f"{prefix}.raw_copy", "hand": f"{prefix}.predictions.hand"}
    admin = AdminClient({"bootstrap.servers": stack.bootstrap_servers})
    for future in admin.create_topics([NewTopic(t, num_partitions=3, replication_factor=1)
                                       for t in topics.values()], operation_timeout=30).values():
        future.result(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait for the leaders
        metadata = admin.list_topics(timeout=10)
        if all(t in metadata.topics and all(p.leader >= 0 for p in metadata.topics[t].partitions.values())
               for t in topics.values()):
            break
        time.sleep(0.2)
    return topics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,64,256,1024", help="batch sizes of the sweep")
    parser.add_argument("--rows", type=int, default=20_000, help="rows per batch size (N)")
    parser.add_argument("--batches", type=int, default=200,
                        help="most batches at a batch size below 64 (one Triton round trip each: slow by nature)")
    parser.add_argument("--model", default="anomaly")
    parser.add_argument("--version", default="1")
    parser.add_argument("--exactly-once", default="", metavar="SIZES",
                        help="batch sizes at which the worker also runs in exactly-once mode, for its ratio to "
                             "at-least-once on the same rows (e.g. 256, the topology's default)")
    args = parser.parse_args(argv)
    stack = StackSettings()
    sizes = [int(s) for s in args.sizes.split(",")]
    eos_sizes = {int(s) for s in args.exactly_once.split(",") if s}
    model_path = stack.model_repository / args.model / args.version / "model.onnx"
    plan = {size: args.rows if size >= 64 else min(args.rows, size * args.batches) for size in sizes}
    total = sum(plan.values())
    data = feature_rows(total)
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    print(f"stack: kafka {stack.bootstrap_servers}, triton {stack.triton_grpc_url}, model {args.model}:{args.version}; "
          f"commit {commit()}; {load()}")
    results = []
    offset = 0
    for size in sizes:
        rows = plan[size]
        matrix = data[offset:offset + rows]
        offset += rows
        batches = [matrix[i:i + size] for i in range(0, rows, size)]
        own = create_topics(stack, f"{prefix}b{size}")
        produce(stack, own["in"], matrix)
        worker = run_worker(stack, own, size, rows, args.model, args.version)
        eos = run_worker(stack, own, size, rows, args.model, args.version, exactly_once=True) \
            if size in eos_sizes else None
        triton = run_triton(stack, batches, args.model, args.version)
        onnx = run_onnxruntime(model_path, batches)
        kafka = Result(rows, raw_copy_seconds(stack, own["in"], own["raw"], rows, batch=size), [])
        hand = run_hand_written(stack, own, size, rows, args.model, args.version)
        results.append((size, rows, worker, eos, triton, onnx, kafka, hand))
        print(f"  batch {size:>5}: {rows} rows done", flush=True)

    header = (f"{'batch':>6} {'rows':>7} | {'worker rows/s':>13} {'hand rows/s':>11} {'triton rows/s':>13} "
              f"{'kafka rows/s':>12} {'ort rows/s':>11} | {'w/hand':>6} {'w/triton':>8} {'w/ceiling':>9} {'w/ort':>6} | "
              f"{'worker p50/p99 ms':>17} {'triton p50/p99 ms':>17} {'ort p50/p99 ms':>15}")
    print()
    print(header)
    print("-" * len(header))
    for size, rows, worker, _, triton, onnx, kafka, hand in results:
        ceiling = min(triton.rows_per_s, kafka.rows_per_s)
        print(f"{size:>6} {rows:>7} | {worker.rows_per_s:>13,.0f} {hand.rows_per_s:>11,.0f} {triton.rows_per_s:>13,.0f} "
              f"{kafka.rows_per_s:>12,.0f} {onnx.rows_per_s:>11,.0f} | {worker.rows_per_s / hand.rows_per_s:>6.2f} "
              f"{worker.rows_per_s / triton.rows_per_s:>8.2f} "
              f"{worker.rows_per_s / ceiling:>9.2f} {worker.rows_per_s / onnx.rows_per_s:>6.3f} | "
              f"{worker.percentile(50):>7.2f}/{worker.percentile(99):>8.2f} "
              f"{triton.percentile(50):>7.2f}/{triton.percentile(99):>8.2f} "
              f"{onnx.percentile(50):>6.3f}/{onnx.percentile(99):>7.3f}")
    print("\nworker: consume + decode + Triton + encode + produce + broker acks + commit (at-least-once), pipelined; "
          "hand: the same job written by hand (confluent-kafka + fastavro + tritonclient, one batch at a time); "
          "kafka: the raw consume → produce → acks → commit loop over the same records; "
          "ceiling: the lower of the triton and kafka rates.")
    for size, rows, worker, eos, triton, _, kafka, hand in results:
        goal = " (goal ≥ 0.8)" if size in (64, 256) else ""
        emit(Figure(f"inference worker, batch {size} (pipelined, at-least-once)", f"{worker.rows_per_s:,.0f} rows/s",
                    f"the same job by hand (Kafka + fastavro + tritonclient) {hand.rows_per_s:,.0f} rows/s; direct "
                    f"tritonclient on the same batches {triton.rows_per_s:,.0f} rows/s; raw Kafka loop "
                    f"{kafka.rows_per_s:,.0f}",
                    f"{worker.rows_per_s / hand.rows_per_s:.2f} of by hand{goal}; {worker.rows_per_s / triton.rows_per_s:.2f} "
                    f"of direct tritonclient", n=rows, batch=size, benchmark="bench_inference"))
        if eos is not None:
            emit(Figure(f"inference worker, batch {size}, exactly-once (a transaction per 100 ms of batches)",
                        f"{eos.rows_per_s:,.0f} rows/s (p99 {eos.percentile(99):.0f} ms a batch)",
                        f"at-least-once on the same rows {worker.rows_per_s:,.0f} rows/s",
                        f"{eos.rows_per_s / worker.rows_per_s:.2f} (goal ≥ 0.7)", n=rows, batch=size,
                        benchmark="bench_inference"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
