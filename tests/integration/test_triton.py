"""The real Triton: `inference_workers/triton_server.py` on the CPU, called through TritonModel
and ModelRepository (explicit model control).

The server runs in the model-server environment (.venv-triton) against a temporary model
repository holding two versions of a small ONNX model with the anomaly contract (different weights),
with the checked-in config.pbtxt (version policy: the latest one), on ports 28000-28002 (shifted by
TANGRAM_TEST_PORT_OFFSET). If it cannot start, these tests fail (they never skip): the local stack
needs it. Tests that load or unload versions put the server back to version 2 alone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
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

from inference_workers.triton_client import (
    ModelContract,
    ModelRepository,
    TensorContract,
    TritonModel,
    VersionState,
)
from reference import PM
from reference import REPO as PROJECT_ROOT
from streams.errors import InferenceError, InferenceUnavailableError
from streams.settings import StackSettings
from streams.stack.components import TRITON_SERVER

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
_OFFSET = int(os.environ.get("TANGRAM_TEST_PORT_OFFSET", "0"))
HTTP_PORT, GRPC_PORT, METRICS_PORT = 28000 + _OFFSET, 28001 + _OFFSET, 28002 + _OFFSET
GRPC_URL = f"{HOST}:{GRPC_PORT}"
READY_URL = f"http://{HOST}:{HTTP_PORT}/v2/health/ready"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
CONFIG = PM / "model_repository" / "anomaly" / "config.pbtxt"
ANOMALY_CONTRACT = ModelContract.from_config(CONFIG.parent)
#: The checked-in config's input: the reference feature vector (27 window aggregates, 3 register attributes).
(WIDTH,) = ANOMALY_CONTRACT.input.dims


def write_anomaly_model(path: Path, seed: int = 7, features: int = WIDTH) -> None:
    """A small ONNX model with the anomaly contract: softmax(features @ W + b), batch dimension free."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=(features, 3)).astype(np.float32)
    bias = rng.normal(size=(3,)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["features", "W"], ["logits_raw"]),
            helper.make_node("Add", ["logits_raw", "b"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1),
        ],
        "anomaly",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", features])],
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
    (repository / "anomaly" / "labels.txt").write_text((CONFIG.parent / "labels.txt").read_text())
    write_anomaly_model(repository / "anomaly" / "1" / "model.onnx", seed=7)
    write_anomaly_model(repository / "anomaly" / "2" / "model.onnx", seed=8)  # other weights

    python = StackSettings().triton_python
    if not python.exists():
        pytest.fail(f"{python} is missing: create the model-server environment with `make .venv-triton/.installed`")
    if _ready():
        pytest.fail(f"something already answers on {READY_URL}: free ports {HTTP_PORT}-{METRICS_PORT}")

    log = root / "triton.log"
    command = [
        str(python), str(TRITON_SERVER),
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


def reference(repository: Path, batch: np.ndarray, version: int = 2) -> np.ndarray:
    """What onnxruntime answers for ``batch`` with that version's file (2: the one served at start)."""
    path = repository / "anomaly" / str(version) / "model.onnx"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (probabilities,) = session.run(["probabilities"], {"features": batch})
    return probabilities


def control(action) -> object:
    """Run ``action(repository)`` (a coroutine function) with a ModelRepository on the test server."""

    async def run() -> object:
        async with ModelRepository(GRPC_URL, timeout_s=10.0, load_timeout_s=60.0) as repository:
            return await action(repository)

    return asyncio.run(run())


def infer(version: str, batch: np.ndarray) -> np.ndarray:
    async def call() -> np.ndarray:
        async with TritonModel(GRPC_URL, "anomaly", version, timeout_s=30.0, contract=ANOMALY_CONTRACT) as model:
            return await model.infer(batch)

    return asyncio.run(call())


def states() -> dict[str, str]:
    """version -> Triton's state of each version of 'anomaly' in the repository index."""
    index: list[VersionState] = control(lambda r: r.index())  # type: ignore[assignment]
    return {v.version: v.state for v in index if v.model == "anomaly"}


@pytest.fixture
def back_to_version_2() -> Iterator[None]:
    """After the test, Triton serves version 2 alone again (as at start)."""
    yield
    control(lambda r: r.load("anomaly", [2]))


# ---------------------------------------------------------------- tests (the SIGTERM one stays last)


def test_server_is_ready_and_serves_the_declared_config(server: Server) -> None:
    async def check() -> None:
        model = TritonModel(GRPC_URL, "anomaly", contract=ANOMALY_CONTRACT)
        try:
            assert await model.is_ready()
            await model.setup()
            assert model.max_batch_size == 1024
            config = (await model._grpc().get_model_config("anomaly")).config
            assert list(config.dynamic_batching.preferred_batch_size) == [64, 256, 1024]
            assert config.dynamic_batching.max_queue_delay_microseconds == 2000
            assert sum(g.count for g in config.instance_group) == 1
            # the ONNX platform, as NVIDIA's image reports it; run by the Python-based onnxruntime backend
            assert (config.platform, config.backend, config.runtime) == ("onnxruntime_onnx", "onnxruntime", "model.py")
            metadata = await model._grpc().get_model_metadata("anomaly")
            assert metadata.platform == "onnxruntime_onnx"
        finally:
            await model.close()

    asyncio.run(check())
    # explicit model control: the config's version policy (the latest one) chose what was loaded at start
    assert states() == {"2": "READY"}


@pytest.mark.parametrize("rows", [1, 1000, 2500])
def test_triton_returns_what_onnxruntime_returns(server: Server, rows: int) -> None:
    batch = np.random.default_rng(rows).normal(size=(rows, WIDTH)).astype(np.float32)

    async def infer() -> np.ndarray:
        async with TritonModel(GRPC_URL, "anomaly", timeout_s=30.0, contract=ANOMALY_CONTRACT) as model:
            return await model.infer(batch)

    probabilities = asyncio.run(infer())
    assert probabilities.shape == (rows, 3)
    assert probabilities.dtype == np.float32
    np.testing.assert_allclose(probabilities, reference(server.repository, batch), rtol=0, atol=1e-5)


def test_concurrent_calls_are_answered_each_with_its_own_rows(server: Server) -> None:
    batches = [np.random.default_rng(i).normal(size=(n, WIDTH)).astype(np.float32) for i, n in enumerate([1, 7, 64, 300])]

    async def infer_all() -> list[np.ndarray]:
        async with TritonModel(GRPC_URL, "anomaly", timeout_s=30.0, contract=ANOMALY_CONTRACT) as model:
            return await asyncio.gather(*(model.infer(b) for b in batches))

    for batch, result in zip(batches, asyncio.run(infer_all())):
        np.testing.assert_allclose(result, reference(server.repository, batch), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("contract", "message"),
    [
        (
            ModelContract(TensorContract("features", "FP32", (WIDTH - 1,)), ANOMALY_CONTRACT.output),
            f"input 'features' dims [{WIDTH}] != declared [{WIDTH - 1}]",
        ),
        (
            ModelContract(TensorContract("features", "FP64", (WIDTH,)), ANOMALY_CONTRACT.output),
            "input 'features' datatype FP32 != declared FP64",
        ),
        (
            ModelContract(TensorContract("telemetry", "FP32", (WIDTH,)), ANOMALY_CONTRACT.output),
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
        async with TritonModel(GRPC_URL, "no_such_model", contract=ANOMALY_CONTRACT):
            pass

    with pytest.raises(InferenceError, match="no_such_model"):
        asyncio.run(setup())


def test_a_batch_off_contract_is_refused_before_sending(server: Server) -> None:
    async def infer() -> None:
        async with TritonModel(GRPC_URL, "anomaly", contract=ANOMALY_CONTRACT) as model:
            await model.infer(np.zeros((4, WIDTH - 1), dtype=np.float32))

    with pytest.raises(InferenceError, match=rf"batch shape \[4, {WIDTH - 1}\] does not fit input 'features' dims \[{WIDTH}\]"):
        asyncio.run(infer())


def test_a_call_past_its_deadline_raises(server: Server) -> None:
    """Triton frozen (SIGSTOP): the call's deadline fires. (A tiny deadline alone races a fast server.)"""
    batch = np.zeros((1024, WIDTH), dtype=np.float32)
    servers = [p for p in descendants(server.process.pid) if Path(f"/proc/{p}/exe").resolve().name == "tritonserver"]
    assert servers

    async def infer() -> None:
        async with TritonModel(GRPC_URL, "anomaly", timeout_s=5.0, contract=ANOMALY_CONTRACT) as model:
            model.timeout_s = 0.5  # set up with a sane deadline, then call a frozen server
            for pid in servers:
                os.kill(pid, signal.SIGSTOP)
            try:
                await model.infer(batch)
            finally:
                for pid in servers:
                    os.kill(pid, signal.SIGCONT)

    started = time.monotonic()
    with pytest.raises(InferenceUnavailableError, match="deadline exceeded"):
        asyncio.run(infer())
    assert time.monotonic() - started < 5.0


def test_an_unreachable_server_raises(server: Server) -> None:
    async def setup() -> None:
        async with TritonModel(f"{HOST}:1", "anomaly", timeout_s=2.0, contract=ANOMALY_CONTRACT):
            pass

    with pytest.raises(InferenceError, match="unavailable|deadline exceeded"):
        asyncio.run(setup())

    async def ready() -> bool:
        model = TritonModel(f"{HOST}:1", "anomaly", timeout_s=1.0, contract=ANOMALY_CONTRACT)
        try:
            return await model.is_ready()
        finally:
            await model.close()

    assert asyncio.run(ready()) is False


def test_a_second_server_on_the_same_ports_exits_at_once(server: Server) -> None:
    command = [
        str(StackSettings().triton_python), str(TRITON_SERVER),
        "--model-repository", str(server.repository),
        "--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT),
    ]  # fmt: skip
    result = subprocess.run(command, check=False, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "Address already in use" in result.stdout
    assert _ready()  # the first one still serves


def test_two_versions_of_one_name_serve_side_by_side_each_with_its_own_weights(
    server: Server, back_to_version_2: None
) -> None:
    batch = np.random.default_rng(3).normal(size=(50, WIDTH)).astype(np.float32)
    loaded = control(lambda r: r.serve("anomaly", {"1"}))  # load the new beside the one served
    assert loaded == {"1"}
    assert states() == {"1": "READY", "2": "READY"}
    one, two = infer("1", batch), infer("2", batch)
    np.testing.assert_allclose(one, reference(server.repository, batch, 1), rtol=0, atol=1e-5)
    np.testing.assert_allclose(two, reference(server.repository, batch, 2), rtol=0, atol=1e-5)
    assert np.abs(one - two).max() > 0.1  # two models, not one answering twice
    assert control(lambda r: r.serve("anomaly", {"1", "2"})) == set()  # both served: no request


def test_loading_and_unloading_never_fails_a_call_to_a_version_that_stays(server: Server, back_to_version_2: None) -> None:
    """Calls to version 2 run throughout: load 1 beside it, unload 1, unload and reload the model's other versions."""
    batch = np.random.default_rng(4).normal(size=(8, WIDTH)).astype(np.float32)
    expected = reference(server.repository, batch, 2)
    stop, answered, failures = threading.Event(), [0], []

    async def call_version_2() -> None:
        async with TritonModel(GRPC_URL, "anomaly", "2", timeout_s=10.0, contract=ANOMALY_CONTRACT) as model:
            while not stop.is_set():
                try:
                    np.testing.assert_allclose(await model.infer(batch), expected, rtol=0, atol=1e-5)
                    answered[0] += 1
                except (InferenceError, AssertionError) as exc:
                    failures.append(str(exc))

    caller = threading.Thread(target=lambda: asyncio.run(call_version_2()))
    caller.start()
    try:
        time.sleep(0.3)
        assert control(lambda r: r.serve("anomaly", {"1"})) == {"1"}  # Triton reloads 2 as well: seamless
        assert control(lambda r: r.retire("anomaly", {"1"})) == {"1"}
        time.sleep(0.3)
    finally:
        stop.set()
        caller.join(60)
    print(f"\n{answered[0]} calls to version 2 while version 1 was loaded and unloaded, {len(failures)} failed")
    assert answered[0] > 50 and failures == []
    deadline = time.monotonic() + 10
    while states().get("1") != "UNAVAILABLE" and time.monotonic() < deadline:
        time.sleep(0.1)  # UNLOADING until its stub has stopped
    assert states() == {"1": "UNAVAILABLE", "2": "READY"}


def test_a_call_to_an_unloaded_version_is_unavailable_not_wrong(server: Server, back_to_version_2: None) -> None:
    """What a worker replica that has not switched yet sees: "retry later" (backpressure), never an answer."""
    batch = np.zeros((4, WIDTH), dtype=np.float32)

    async def setup() -> None:
        async with TritonModel(GRPC_URL, "anomaly", "1", timeout_s=10.0, contract=ANOMALY_CONTRACT):  # a client loads nothing
            pass

    with pytest.raises(InferenceUnavailableError, match="version 1"):
        asyncio.run(setup())
    control(lambda r: r.serve("anomaly", {"1"}))
    np.testing.assert_allclose(infer("1", batch), reference(server.repository, batch, 1), rtol=0, atol=1e-5)
    control(lambda r: r.retire("anomaly", {"1"}))
    with pytest.raises(InferenceUnavailableError, match="unavailable"):
        infer("1", batch)
    np.testing.assert_allclose(infer("2", batch), reference(server.repository, batch, 2), rtol=0, atol=1e-5)


def test_a_version_triton_cannot_load_is_refused_and_the_served_ones_stay(server: Server, back_to_version_2: None) -> None:
    (server.repository / "anomaly" / "3").mkdir(exist_ok=True)
    (server.repository / "anomaly" / "3" / "model.onnx").write_bytes(b"not an onnx file")
    write_anomaly_model(server.repository / "anomaly" / "4" / "model.onnx", features=WIDTH - 1)  # off contract
    try:
        with pytest.raises(InferenceError, match=r"version 3 .*onnxruntime cannot load"):
            control(lambda r: r.serve("anomaly", {"3"}))
        with pytest.raises(InferenceError, match=rf"input 'features' has shape \['batch', {WIDTH - 1}\].*declares \[-1, {WIDTH}\]"):
            control(lambda r: r.serve("anomaly", {"4"}))
        with pytest.raises(InferenceError, match="is every version asked for a folder"):
            control(lambda r: r.load("anomaly", [9]))
        with pytest.raises(InferenceError, match="no_such_model"):
            control(lambda r: r.serve("no_such_model", {"1"}))
    finally:
        for version in ("3", "4"):
            for path in (server.repository / "anomaly" / version).iterdir():
                path.unlink()
            (server.repository / "anomaly" / version).rmdir()
    assert states()["2"] == "READY"
    assert _ready()  # a failed load leaves the server ready: the served versions answer
    batch = np.ones((2, WIDTH), dtype=np.float32)
    np.testing.assert_allclose(infer("2", batch), reference(server.repository, batch, 2), rtol=0, atol=1e-5)


def test_unloading_the_model_then_serving_a_version_again(server: Server, back_to_version_2: None) -> None:
    control(lambda r: r.unload("anomaly"))
    deadline = time.monotonic() + 10
    while states().get("2") != "UNAVAILABLE" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not {v for v, state in states().items() if state == "READY"}

    async def version_2_ready() -> bool:
        model = TritonModel(GRPC_URL, "anomaly", "2", contract=ANOMALY_CONTRACT)
        try:
            return await model.is_ready()
        finally:
            await model.close()

    assert not asyncio.run(version_2_ready())
    assert control(lambda r: r.serve("anomaly", {"1"})) == {"1"}  # from nothing: its config is read from the repository
    assert states().get("1") == "READY"
    assert _ready()  # the server stayed ready throughout (see the server's docstring: not strict)


def test_a_bad_repository_is_refused_before_triton_starts(tmp_path: Path) -> None:
    (tmp_path / "anomaly").mkdir()
    (tmp_path / "anomaly" / "config.pbtxt").write_text(CONFIG.read_text())
    (tmp_path / "anomaly" / "labels.txt").write_text((CONFIG.parent / "labels.txt").read_text())
    write_anomaly_model(tmp_path / "anomaly" / "1" / "model.onnx", features=WIDTH - 1)
    command = [
        str(StackSettings().triton_python), str(TRITON_SERVER),
        "--model-repository", str(tmp_path),
        "--http-port", str(HTTP_PORT + 50), "--grpc-port", str(GRPC_PORT + 50), "--metrics-port", str(METRICS_PORT + 50),
    ]  # fmt: skip
    result = subprocess.run(command, check=False, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"model 'anomaly' version 1: input 'features' has shape ['batch', {WIDTH - 1}]" in result.stdout
    assert "starting" not in result.stdout  # refused before tritonserver starts


def test_sigterm_stops_the_server_and_every_child(server: Server) -> None:
    process = server.process
    children = descendants(process.pid)
    names = {Path(f"/proc/{p}/exe").resolve().name for p in children if Path(f"/proc/{p}").exists()}
    assert "tritonserver" in names, f"no tritonserver among the children: {names}"
    assert "triton_python_backend_stub" in names, f"no Python-backend stub among the children: {names}"
    regions = f"tangram-triton-{process.pid}-*"
    assert list(Path("/dev/shm").glob(regions)), "the stubs' shared memory is not where it is looked for"

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
    assert not list(Path("/dev/shm").glob(regions)), "shared memory left behind in /dev/shm"
