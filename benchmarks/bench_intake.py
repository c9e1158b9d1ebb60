"""Document-intake benchmark: documents/s and latency through the app against PP-OCR run directly, in one run.

The same generated documents (ID cards and business licences, half photographed badly) go through:

1. **onnxruntime**: the app's own OCR code (``intake_app.ocr``) with the three ONNX files opened by
   onnxruntime in this process, one intra-op thread per session as the local Triton's backend runs
   them, one document after the other, then the extraction: the floor of what the models cost here;
2. **triton**: the same code, the models behind the local Triton (gRPC), documents in micro-batches
   of the OCR stage's size: what the Triton hop adds;
3. **app**: the app's processors (intake → ocr → extract → rules) on the local stack under a namespace
   of their own, the documents produced to the raw topic at once: documents decided per second (first
   produced to last decided) and per document the upload → decision latency (p50/p99).

And the Triton batching gain of the recogniser: the text lines of the documents sent one request a
line, then grouped by width (the stage's way), with the same lines through onnxruntime both ways.

It needs a running stack (``tangram up``) with the app applied (``tangram models build`` and
``tangram apply topologies/document_intake``). Not a test: figures, not assertions::

    .venv/bin/python benchmarks/bench_intake.py --documents 16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from datetime import date
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "topologies" / "document_intake"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(APP))

from inference_workers.triton_client import ModelContract, TritonModel  # noqa: E402
from intake_app.extraction import extract, load_spec  # noqa: E402
from intake_app.generator import Generator  # noqa: E402
from intake_app.models import read_characters  # noqa: E402
from intake_app.ocr import CLS, DET, REC, OcrEngine, OcrSettings, Timings, crop_line, decode_image, det_input, \
    rec_batches, text_boxes  # noqa: E402
from report import Figure, emit  # noqa: E402
from streams.payloads import PayloadStore  # noqa: E402
from streams.settings import StackSettings  # noqa: E402
from streams.testing import AppHarness, read_rows  # noqa: E402

REPOSITORY = APP / "model_repository"
STAGE_BATCH = 4  # documents per OCR micro-batch (the ocr processor's batch_size)
#: One event loop for the run: the gRPC clients of the Triton path belong to the loop they first ran in.
LOOP = asyncio.new_event_loop()


def sessions() -> dict[str, ort.InferenceSession]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return {m: ort.InferenceSession(str(REPOSITORY / m / "1" / "model.onnx"), options,
                                    providers=["CPUExecutionProvider"]) for m in (DET, REC, CLS)}


def onnx_infer(models: dict[str, ort.InferenceSession]):
    async def infer(model: str, batch: np.ndarray) -> np.ndarray:
        session = models[model]
        return session.run(None, {session.get_inputs()[0].name: batch})[0]
    return infer


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def direct(images: list[np.ndarray], engine: OcrEngine, batch: int) -> tuple[float, list[float], Timings]:
    """Seconds for every document, per-document latency (ms), the step timings."""
    spec = load_spec(APP / "extraction.yaml")
    timings, latencies = Timings(), []
    started = time.perf_counter()
    for i in range(0, len(images), batch):
        t = time.perf_counter()
        for lines in LOOP.run_until_complete(engine.read(images[i:i + batch], timings=timings)):
            extract(lines, spec, date.today())
        latencies += [(time.perf_counter() - t) * 1000] * len(images[i:i + batch])
    return time.perf_counter() - started, latencies, timings


def triton_engine(stack: StackSettings) -> tuple[OcrEngine, dict[str, TritonModel]]:
    models = {m: TritonModel(stack.triton_grpc_url, m, timeout_s=60, contract=ModelContract.from_config(REPOSITORY / m))
              for m in (DET, REC, CLS)}

    async def infer(model: str, batch: np.ndarray) -> np.ndarray:
        return await models[model].infer(batch)
    return OcrEngine(infer, read_characters(REPOSITORY / REC)), models


def lines_of(images: list[np.ndarray], engine_infer) -> list[np.ndarray]:
    """The text-line crops of the documents (detection through ``engine_infer``)."""
    s = OcrSettings()
    crops = []
    for image in images:
        x = det_input(image, s.det_limit)
        prob = LOOP.run_until_complete(engine_infer(DET, x[None]))[0, 0]
        crops += [crop_line(image, box) for box in text_boxes(prob, image.shape[:2], s)]
    return crops


def rec_rate(crops: list[np.ndarray], infer, batch: int) -> float:
    """Lines recognised per second, ``batch`` lines a request grouped by width (requests in flight together)."""
    batches = rec_batches(crops, OcrSettings(rec_batch=batch))

    async def run() -> None:
        await asyncio.gather(*(infer(REC, x) for _, x in batches))
    started = time.perf_counter()
    LOOP.run_until_complete(run())
    return len(crops) / (time.perf_counter() - started)


def through_app(stack: StackSettings, documents) -> tuple[float, list[float], int]:
    """Documents/s through the app's processors and the upload → decision latencies (ms)."""
    with AppHarness(APP, stack, processors=["intake", "ocr", "extract", "rules"]) as app:
        store = PayloadStore.of(app.topology, stack)
        produced: dict[str, int] = {}
        records = []
        for d in documents:
            doc_id = f"bench-{uuid.uuid4().hex[:10]}"
            now = int(time.time() * 1000)
            produced[doc_id] = now
            records.append({"doc_id": doc_id, "device_id": "bench", "uploaded_ms": now, "filename": "",
                            "content_type": d.content_type, **store.inline(d.image, "image")})
        started_ms = time.time() * 1000
        app.send("intake.raw.documents", records, key="doc_id", id_field="doc_id")
        decided: dict[str, float] = {}
        deadline = time.monotonic() + 60 + 15 * len(documents)
        while len(decided) < len(records) and time.monotonic() < deadline:
            for topic in ("intake.actions.approve", "intake.actions.review", "intake.actions.reject"):
                target = app.topic(topic)
                for msg in read_rows(stack.kafka, target, None, app.topology.partitions(target),
                                     idle_s=1.0, timeout_s=5.0):
                    decided.setdefault(msg.key().decode(), float(msg.timestamp()[1]))
        elapsed_s = (max(decided.values(), default=started_ms) - started_ms) / 1000
        latencies = [decided[d] - produced[d] for d in decided]
        return len(decided) / elapsed_s if elapsed_s > 0 else float("nan"), latencies, len(decided)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=16, help="Documents of each path.")
    parser.add_argument("--line-documents", type=int, default=6, help="Documents whose text lines the recogniser "
                                                                       "batching compares.")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--rec-batches", default="1,4,16,64", help="Lines a recogniser request, compared (first: "
                                                                   "the baseline of the gain).")
    parser.add_argument("--skip-app", action="store_true", help="Only the direct paths (no Kafka): a GPU Triton run.")
    args = parser.parse_args()
    stack = StackSettings()
    g = Generator(args.seed)
    documents = [g.document(i) for i in range(args.documents)]
    images = [decode_image(d.image) for d in documents]
    print(f"{len(documents)} documents ({sum(d.doc_type == 'id_card' for d in documents)} ID cards), "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")

    models = sessions()
    ort_s, ort_lat, ort_t = direct(images, OcrEngine(onnx_infer(models), read_characters(REPOSITORY / REC)), 1)
    print(f"onnxruntime (in process, 1 doc at a time): {len(images) / ort_s:6.2f} documents/s, "
          f"latency p50 {pct(ort_lat, 50):,.0f} ms p99 {pct(ort_lat, 99):,.0f} ms; {ort_t.lines} lines")
    steps = {k: getattr(ort_t, k) for k in ("pre", "det", "boxes", "cls", "rec", "decode")}
    total = sum(steps.values())
    print("  where the time goes: " + ", ".join(f"{k} {v / total:.0%}" for k, v in steps.items()))

    engine, tmodels = triton_engine(stack)
    tri_s, tri_lat, _ = direct(images, engine, STAGE_BATCH)
    print(f"triton (gRPC, {STAGE_BATCH} docs a batch):         {len(images) / tri_s:6.2f} documents/s, "
          f"batch latency p50 {pct(tri_lat, 50):,.0f} ms p99 {pct(tri_lat, 99):,.0f} ms; "
          f"ratio to onnxruntime {ort_s / tri_s:.2f}")
    emit(Figure("document intake: the app's OCR code with the models behind the local Triton (gRPC)",
                f"{len(images) / tri_s:.2f} documents/s", f"the same models in onnxruntime in process "
                f"{len(images) / ort_s:.2f} documents/s", f"{ort_s / tri_s:.2f}", n=len(images), batch=STAGE_BATCH,
                benchmark="bench_intake"))

    crops = lines_of(images[:args.line_documents], onnx_infer(models))
    sizes = [int(b) for b in args.rec_batches.split(",")]
    for name, infer in (("triton", engine.infer), ("onnxruntime", onnx_infer(models))):
        rates = {b: rec_rate(crops, infer, b) for b in sizes}
        print(f"recogniser on {name:<11}: {len(crops)} lines, "
              + ", ".join(f"{b} a request {r:6.1f} lines/s ({r / rates[sizes[0]]:.2f}x)" for b, r in rates.items()))
        if name == "triton":
            emit(Figure(f"document intake: recogniser requests of {' / '.join(map(str, sizes[1:]))} text lines "
                        "(Triton)", " / ".join(f"{rates[b]:.1f}" for b in sizes[1:]) + " lines/s",
                        f"one line a request {rates[sizes[0]]:.1f} lines/s",
                        " / ".join(f"{rates[b] / rates[sizes[0]]:.2f}" for b in sizes[1:]), n=len(crops),
                        batch=args.rec_batches, benchmark="bench_intake"))

    if not args.skip_app:
        rate, latencies, n = through_app(stack, documents)
        print(f"app (intake → ocr → extract → rules, Kafka): {rate:6.2f} documents/s decided ({n}/{len(documents)}), "
              f"upload → decision p50 {pct(latencies, 50):,.0f} ms p99 {pct(latencies, 99):,.0f} ms; "
              f"ratio to onnxruntime {rate / (len(images) / ort_s):.2f}")
        emit(Figure("document intake: uploads → decisions through the app (intake → ocr → extract → rules, "
                    "PP-OCR on the local Triton)", f"{rate:.2f} documents/s ({n} of {len(documents)} decided), "
                    f"upload → decision p50 {pct(latencies, 50):,.0f} ms, p99 {pct(latencies, 99):,.0f} ms",
                    f"the same models in onnxruntime in one process {len(images) / ort_s:.2f} documents/s",
                    f"{rate / (len(images) / ort_s):.2f}", n=len(documents), batch=STAGE_BATCH,
                    benchmark="bench_intake"))


if __name__ == "__main__":
    main()
