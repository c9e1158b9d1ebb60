"""The real Triton: `python -m inference_workers.triton_server` on the CPU, called through TritonModel.

The server runs in the model-server environment (.venv-triton) against a temporary model
repository holding a small ONNX model with the anomaly contract, on ports 28000-28002. If it
cannot start, these tests fail (they never skip): the local stack needs it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from inference_workers.triton_client import ANOMALY_CONTRACT, ModelContract, TensorContract, TritonModel
from streams import PROJECT_ROOT
from streams.errors import InferenceError
from streams.settings import StackSettings

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
_OFFSET = int(os.environ.get("TANGRAM_TEST_PORT_OFFSET", "0"))
HTTP_PORT, GRPC_PORT, METRICS_PORT = 28000 + _OFFSET, 28001 + _OFFSET, 28002 + _OFFSET
GRPC_URL = f"{HOST}:{GRPC_PORT}"
READY_URL = f"http://{HOST}:{HTTP_PORT}/v2/health/ready"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
CONFIG = PROJECT_ROOT / "inference_workers" / "model_repository" / "anomaly" / "config.pbtxt"


def write_anomaly_model(path: Path, seed: int = 7) -> None:
    """A small ONNX model with the anomaly contract: softmax(features @ W + b), batch dimension free."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=(27, 3)).astype(np.float32)
    bias = rng.normal(size=(3,)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["features", "W"], ["logits_raw"]),
            helper.make_node("Add", ["logits_raw", "b"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1),
        ],
        "anomaly",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 27])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 3])],
        initializer=[numpy_helper.from_array(weights, "W"), numpy_helper.from_array(bias, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # opset 17's IR version: loadable by older onnxruntime builds too
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


# ---------------------------------------------------------------- process helpers


def _process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, session id, state) of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
        table[int(entry)] = (int(fields[1]), int(fields[3]), fields[0])
    return table


def descendants(pid: int) -> set[int]:
    table = _process_table()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, (parent, _, _) in table.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int] | None = None, session: int | None = None) -> set[int]:
    """Those of ``pids`` (or of the session ``session``) still running, zombies excluded."""
    return {
        p
        for p, (_, sid, state) in _process_table().items()
        if state != "Z" and ((pids is not None and p in pids) or (session is not None and sid == session))
    }


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    log: Path
    repository: Path
    startup_s: float

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _ready() -> bool:
    try:
        with urllib.request.urlopen(READY_URL, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("triton")
    repository = root / "model_repository"
    (repository / "anomaly").mkdir(parents=True)
    (repository / "anomaly" / "config.pbtxt").write_text(CONFIG.read_text())
    write_anomaly_model(repository / "anomaly" / "1" / "model.onnx")

    python = StackSettings().triton_python
    if not python.exists():
        pytest.fail(f"{python} is missing: create the model-server environment with `make .venv-triton/.installed`")
    if _ready():
        pytest.fail(f"something already answers on {READY_URL}: free ports {HTTP_PORT}-{METRICS_PORT}")

    log = root / "triton.log"
    command = [
        str(python), "-m", "inference_workers.triton_server",
        "--model-repository", str(repository),
        "--host", HOST,
        "--http-port", str(HTTP_PORT),
        "--grpc-port", str(GRPC_PORT),
        "--metrics-port", str(METRICS_PORT),
    ]  # fmt: skip
    started = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    handle = Server(process, log, repository, startup_s=0.0)
    try:
        while not _ready():
            if process.poll() is not None:
                pytest.fail(f"Triton exited with {process.returncode} before it was ready:\n{handle.log_tail()}")
            if time.monotonic() - started > START_TIMEOUT_S:
                pytest.fail(f"Triton not ready within {START_TIMEOUT_S:.0f} s:\n{handle.log_tail()}")
            time.sleep(0.1)
        handle.startup_s = time.monotonic() - started
        print(f"\nTriton ready in {handle.startup_s:.2f} s")
        yield handle
    finally:
        if process.poll() is None:  # the SIGTERM test did not run or failed: leave nothing behind
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(timeout=30)


def reference(repository: Path, batch: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(repository / "anomaly" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    (probabilities,) = session.run(["probabilities"], {"features": batch})
    return probabilities


# ---------------------------------------------------------------- tests (the SIGTERM one stays last)


def test_server_is_ready_and_serves_the_declared_config(server: Server) -> None:
    async def check() -> None:
        model = TritonModel(GRPC_URL, "anomaly")
        try:
            assert await model.is_ready()
            await model.setup()
            assert model.max_batch_size == 1024
            config = (await model._grpc().get_model_config("anomaly")).config
            assert list(config.dynamic_batching.preferred_batch_size) == [64, 256, 1024]
            assert config.dynamic_batching.max_queue_delay_microseconds == 2000
            assert sum(g.count for g in config.instance_group) == 1
        finally:
            await model.close()

    asyncio.run(check())


@pytest.mark.parametrize("rows", [1, 1000, 2500])
def test_triton_returns_what_onnxruntime_returns(server: Server, rows: int) -> None:
    batch = np.random.default_rng(rows).normal(size=(rows, 27)).astype(np.float32)

    async def infer() -> np.ndarray:
        async with TritonModel(GRPC_URL, "anomaly", timeout_s=30.0) as model:
            return await model.infer(batch)

    probabilities = asyncio.run(infer())
    assert probabilities.shape == (rows, 3)
    assert probabilities.dtype == np.float32
    np.testing.assert_allclose(probabilities, reference(server.repository, batch), rtol=0, atol=1e-5)


def test_concurrent_calls_are_answered_each_with_its_own_rows(server: Server) -> None:
    batches = [np.random.default_rng(i).normal(size=(n, 27)).astype(np.float32) for i, n in enumerate([1, 7, 64, 300])]

    async def infer_all() -> list[np.ndarray]:
        async with TritonModel(GRPC_URL, "anomaly", timeout_s=30.0) as model:
            return await asyncio.gather(*(model.infer(b) for b in batches))

    for batch, result in zip(batches, asyncio.run(infer_all())):
        np.testing.assert_allclose(result, reference(server.repository, batch), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("contract", "message"),
    [
        (
            ModelContract(TensorContract("features", "FP32", (26,)), ANOMALY_CONTRACT.output),
            "input 'features' dims [27] != declared [26]",
        ),
        (
            ModelContract(TensorContract("features", "FP64", (27,)), ANOMALY_CONTRACT.output),
            "input 'features' datatype FP32 != declared FP64",
        ),
        (
            ModelContract(TensorContract("telemetry", "FP32", (27,)), ANOMALY_CONTRACT.output),
            "has no input 'telemetry'",
        ),
        (
            ModelContract(ANOMALY_CONTRACT.input, TensorContract("probabilities", "FP32", (2,))),
            "output 'probabilities' dims [3] != declared [2]",
        ),
        (
            ModelContract(ANOMALY_CONTRACT.input, ANOMALY_CONTRACT.output, max_batch_size=64),
            "max_batch_size 1024 != declared 64",
        ),
    ],
)
def test_a_wrong_contract_is_refused_naming_the_field(server: Server, contract: ModelContract, message: str) -> None:
    async def setup() -> None:
        model = TritonModel(GRPC_URL, "anomaly", contract=contract)
        try:
            await model.setup()
        finally:
            await model.close()

    with pytest.raises(InferenceError) as caught:
        asyncio.run(setup())
    assert message in str(caught.value)


def test_an_unknown_model_is_refused(server: Server) -> None:
    async def setup() -> None:
        async with TritonModel(GRPC_URL, "no_such_model"):
            pass

    with pytest.raises(InferenceError, match="no_such_model"):
        asyncio.run(setup())


def test_a_batch_off_contract_is_refused_before_sending(server: Server) -> None:
    async def infer() -> None:
        async with TritonModel(GRPC_URL, "anomaly") as model:
            await model.infer(np.zeros((4, 26), dtype=np.float32))

    with pytest.raises(InferenceError, match=r"batch shape \[4, 26\] does not fit input 'features' dims \[27\]"):
        asyncio.run(infer())


def test_a_call_past_its_deadline_raises(server: Server) -> None:
    batch = np.zeros((1024, 27), dtype=np.float32)

    async def infer() -> None:
        async with TritonModel(GRPC_URL, "anomaly", timeout_s=5.0) as model:
            model.timeout_s = 1e-6  # set up with a sane deadline, then call with a tiny one
            await model.infer(batch)

    with pytest.raises(InferenceError, match="deadline exceeded"):
        asyncio.run(infer())


def test_an_unreachable_server_raises(server: Server) -> None:
    async def setup() -> None:
        async with TritonModel(f"{HOST}:1", "anomaly", timeout_s=2.0):
            pass

    with pytest.raises(InferenceError, match="unavailable|deadline exceeded"):
        asyncio.run(setup())

    async def ready() -> bool:
        model = TritonModel(f"{HOST}:1", "anomaly", timeout_s=1.0)
        try:
            return await model.is_ready()
        finally:
            await model.close()

    assert asyncio.run(ready()) is False


def test_a_second_server_on_the_same_ports_exits_at_once(server: Server) -> None:
    command = [
        str(StackSettings().triton_python), "-m", "inference_workers.triton_server",
        "--model-repository", str(server.repository),
        "--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT),
    ]  # fmt: skip
    result = subprocess.run(command, check=False, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "Address already in use" in result.stdout
    assert _ready()  # the first one still serves


def test_sigterm_stops_the_server_and_every_child(server: Server) -> None:
    process = server.process
    children = descendants(process.pid)
    names = {Path(f"/proc/{p}/exe").resolve().name for p in children if Path(f"/proc/{p}").exists()}
    assert "tritonserver" in names, f"no tritonserver among the children: {names}"

    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not stop within {STOP_TIMEOUT_S:.0f} s of SIGTERM:\n{server.log_tail()}")
    assert code == 0, server.log_tail()

    deadline = time.monotonic() + 10.0
    while (left := alive(children, session=process.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind after SIGTERM: {sorted(left)}"
    assert not _ready()
