#!/usr/bin/env bash
# The inference benchmark against NVIDIA's Triton on a GPU, serving the same model repository.
#
# For a machine with an NVIDIA GPU, Docker and the NVIDIA container toolkit; CI never runs it.
# It starts Kafka, the registry and Redis from the project's own stack (no local Triton), starts
# nvcr.io/nvidia/tritonserver with the repository (ONNX Runtime backend, KIND_GPU instances),
# runs benchmarks/bench_inference.py and benchmarks/bench_intake.py (the document-intake app's PP-OCR models)
# against it, and stops everything it started.
#
#   benchmarks/gpu/run_gpu_bench.sh                 # sweep 1..1024
#   SIZES=64,256,1024 TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.08-py3 benchmarks/gpu/run_gpu_bench.sh
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
TRITON_IMAGE="${TRITON_IMAGE:-nvcr.io/nvidia/tritonserver:24.08-py3}"
SIZES="${SIZES:-1,4,16,64,256,1024}"
ROWS="${ROWS:-20000}"
NAME="tangram-gpu-bench-$$"
export TANGRAM_HOME="${TANGRAM_HOME:-$(mktemp -d /tmp/tangram-gpu-bench.XXXX)}"
export TANGRAM_TRITON_HTTP_PORT="${TANGRAM_TRITON_HTTP_PORT:-8000}"
export TANGRAM_TRITON_GRPC_PORT="${TANGRAM_TRITON_GRPC_PORT:-8001}"

command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this script needs an NVIDIA GPU" >&2; exit 1; }
command -v docker >/dev/null || { echo "docker is required to run NVIDIA's Triton image" >&2; exit 1; }
make .venv/.installed model >/dev/null

# The reference app's repository as NVIDIA's Triton reads it; its config names no instance kind, so
# Triton places the model on the GPU.
REPO="$TANGRAM_HOME/model_repository"
mkdir -p "$REPO"
cp -r topologies/predictive_maintenance/model_repository/anomaly "$REPO/"
# The document-intake app's PP-OCR models (copied out of the rapidocr-onnxruntime wheel by `make model`):
# their configs name no instance kind, so Triton places them on the GPU as they are.
cp -r topologies/document_intake/model_repository/ppocr_det topologies/document_intake/model_repository/ppocr_rec \
  topologies/document_intake/model_repository/ppocr_cls "$REPO/"

cleanup() {
  docker rm -f "$NAME" >/dev/null 2>&1 || true
  .venv/bin/python - <<'PY' || true
from streams.settings import StackSettings
from streams.stack import down
down(StackSettings(), only=["kafka", "registry", "redis"])
PY
}
trap cleanup EXIT

.venv/bin/python - <<'PY'
from streams.settings import StackSettings
from streams.stack import up
up(StackSettings(), only=["kafka", "registry", "redis"])
PY

docker run -d --rm --name "$NAME" --gpus all \
  -p "127.0.0.1:${TANGRAM_TRITON_HTTP_PORT}:8000" -p "127.0.0.1:${TANGRAM_TRITON_GRPC_PORT}:8001" \
  -v "$REPO:/models:ro" "$TRITON_IMAGE" tritonserver --model-repository=/models >/dev/null
for _ in $(seq 1 120); do
  curl -fsS "http://127.0.0.1:${TANGRAM_TRITON_HTTP_PORT}/v2/health/ready" >/dev/null 2>&1 && break
  sleep 1
done
curl -fsS "http://127.0.0.1:${TANGRAM_TRITON_HTTP_PORT}/v2/health/ready" >/dev/null \
  || { docker logs "$NAME" | tail -40; echo "Triton on the GPU did not become ready" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

.venv/bin/python benchmarks/bench_inference.py --sizes "$SIZES" --rows "$ROWS"

# The document-intake app against the same GPU Triton: documents/s through its OCR code with the models on
# the GPU (vs onnxruntime in process on the CPU) and the recogniser's batching gain with GPU-sized requests.
.venv/bin/python benchmarks/bench_intake.py --skip-app --documents "${DOCUMENTS:-32}" --rec-batches 1,16,64
