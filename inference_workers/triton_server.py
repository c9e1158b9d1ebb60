"""The local model server: a real Triton Inference Server on the CPU, serving a Triton model repository.

Run it as a script with the interpreter of the model-server environment (``.venv-triton``, numpy<2),
which must not see the application's packages (``tangram up`` does this)::

    .venv-triton/bin/python inference_workers/triton_server.py \\
        --model-repository .tangram/models \\
        --host 127.0.0.1 --http-port 8000 --grpc-port 8001 --metrics-port 8002

It starts the ``tritonserver`` binary that the ``nvidia-pytriton`` wheel ships on the repository
itself, with Triton's **explicit model control** (``--model-control-mode=explicit``): at start
every model folder that holds a ``config.pbtxt`` and a numbered version folder with its ONNX file
is loaded with the versions its ``version_policy`` selects (``--load-model=<name>``); afterwards a
client loads other versions, several versions of one name side by side, and unloads them through
Triton's model-repository API (:class:`inference_workers.triton_client.ModelRepository`).

That binary has only the Python backend. A model config says ``platform: "onnxruntime_onnx"`` (the
ONNX Runtime backend that NVIDIA's image runs); here the backend named ``onnxruntime`` is the
Python-based backend :mod:`inference_workers.triton_onnx_backend`, installed in a private backend
directory as ``backends/onnxruntime/model.py`` beside the wheel's Python backend and its stub. Triton
itself reads each ``config.pbtxt`` and runs the dynamic batcher, the instance groups and the version
policy; each instance of each version is a ``triton_python_backend_stub`` process running the
ONNX file with onnxruntime (one intra-op thread). So the local CPU Triton serves what NVIDIA's
image serves from the same repository: same names, datatypes, shapes, ``max_batch_size``, batching,
instances and versions; its model config adds only ``runtime: "model.py"``.

Readiness is Triton's own ``GET /v2/health/ready``: Triton opens its endpoints only once every model
loaded at start is ready (it exits when one fails to load), so ready means loaded. The readiness is not
"strict": a strict Triton stays unready for good once a client's load of a broken version has failed,
though every served version still answers; each version's own readiness is
``GET /v2/models/<name>/versions/<version>/ready``. SIGTERM or SIGINT stops Triton (in-flight requests get
``EXIT_TIMEOUT_S``), then the stubs; the process exits 0 and removes its backend directory and any
shared-memory region its Python backend left in ``/dev/shm``. A busy port or a bad repository
is refused before Triton starts, with the port or the file in the message (exit code 2).

This module imports only the standard library, numpy, protobuf and tritonclient's
``model_config_pb2`` (and onnxruntime for the pre-flight check), never the application's packages.
A repository with no model yet is served empty: apps install theirs with ``tangram apply``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import importlib.util
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

LOGGER = logging.getLogger("tangram.triton")

#: Seconds Triton waits for in-flight requests when asked to stop (then it unloads the models).
EXIT_TIMEOUT_S = 5
#: Seconds to wait for tritonserver to exit after SIGTERM before it and its stubs are killed: Triton's
#: exit timeout plus unloading, and well inside the stack's 20 s before it kills this process itself.
STOP_GRACE_S = 12.0
#: The Python backend's shared memory per stub: PyTriton's sizes (the backend's default is 64 MiB).
SHM_DEFAULT_BYTES = 4 * 1024 * 1024
SHM_GROWTH_BYTES = 1024 * 1024
#: The Triton backend name of platform ``onnxruntime_onnx``: the one this server provides in Python.
ONNX_BACKEND = "onnxruntime"
#: That backend's ``model.py``. This server runs as a script in the model-server environment, where the
#: application's packages are not importable: the backend is found beside this file.
BACKEND_FILE = Path(__file__).with_name("triton_onnx_backend.py")


def _backend() -> Any:
    """The backend module, loaded from ``BACKEND_FILE`` (for the pre-flight check of each model)."""
    spec = importlib.util.spec_from_file_location("triton_onnx_backend", BACKEND_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TritonSetupError(Exception):
    """The repository cannot be served as its config.pbtxt files declare, or the ports are taken."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model, as config.pbtxt declares it (dims without the batch dimension)."""

    name: str
    dtype: np.dtype
    dims: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One version of one model of the repository that Triton loads at start."""

    name: str
    version: int
    onnx_path: Path
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    dynamic_batching: bool
    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_us: int
    preserve_ordering: bool
    instance_count: int


# --------------------------------------------------------------------------------------------
# The LD_LIBRARY_PATH pitfall
# --------------------------------------------------------------------------------------------


def ensure_own_libpython() -> str | None:
    """Put the running interpreter's ``LIBDIR`` first on ``LD_LIBRARY_PATH`` (for Triton's children).

    The Python-backend stub links ``libpython3.11.so``. Without this, the dynamic loader finds the
    system's libpython instead of this interpreter's (pyenv's, here), and the stub dies with
    ``'_thread.RLock' object has no attribute '_recursion_count'``. tritonserver is started with a
    copy of ``os.environ`` (see :func:`tritonserver_env`), so setting it here is enough.

    Returns the folder that was put first, or None where the interpreter is linked statically.
    """
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    libdir = sysconfig.get_config_var("LIBDIR")
    if not libdir or not Path(libdir).is_dir():
        return None
    current = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    if current[:1] != [libdir]:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([libdir, *(p for p in current if p != libdir)])
    return libdir


# --------------------------------------------------------------------------------------------
# Reading the repository
# --------------------------------------------------------------------------------------------


def _numpy_dtype(data_type: int, where: str) -> np.dtype:
    from tritonclient.grpc import model_config_pb2
    from tritonclient.utils import triton_to_np_dtype

    name = model_config_pb2.DataType.Name(data_type)  # e.g. "TYPE_FP32"
    dtype = triton_to_np_dtype(name.removeprefix("TYPE_"))
    if dtype is None or name in ("TYPE_INVALID", "TYPE_STRING", "TYPE_BF16"):
        raise TritonSetupError(f"{where}: data_type {name} is not supported by the local Triton")
    return np.dtype(dtype)


def parse_model_config(config_path: Path) -> Any:
    """Parse a ``config.pbtxt`` into Triton's ``ModelConfig`` protobuf message."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(config_path.read_text(), model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise TritonSetupError(f"{config_path}: not a valid Triton model config: {exc}") from exc


def _selected_versions(config: Any, available: Sequence[int]) -> list[int]:
    """Apply the config's version_policy the way Triton does (default: the latest one)."""
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    ordered = sorted(available)
    if which == "all":
        return ordered
    if which == "specific":
        return [v for v in ordered if v in set(policy.specific.versions)]
    latest = policy.latest.num_versions if which == "latest" and policy.latest.num_versions > 0 else 1
    return ordered[-latest:]


def _tensor_specs(tensors: Sequence[Any], kind: str, where: str) -> tuple[TensorSpec, ...]:
    specs = []
    for tensor in tensors:
        if tensor.reshape.shape or tensor.is_shape_tensor:
            raise TritonSetupError(f"{where}: {kind} '{tensor.name}': reshape and shape tensors are not supported")
        dtype = _numpy_dtype(tensor.data_type, f"{where}: {kind} '{tensor.name}'")
        specs.append(TensorSpec(name=tensor.name, dtype=dtype, dims=tuple(int(d) for d in tensor.dims)))
    return tuple(specs)


def discover_models(repository: Path) -> list[ModelSpec]:
    """The model versions Triton loads at start (each config's version policy), sorted by name then version.

    A folder without ``config.pbtxt`` or without a numbered version folder holding ``model.onnx``
    is skipped with a warning (the lead's training script may not have written the model yet).
    A folder whose config is invalid or not an ONNX model raises TritonSetupError.
    """
    if not repository.is_dir():
        raise TritonSetupError(f"model repository {repository} is not a folder")
    specs: list[ModelSpec] = []
    for folder in sorted(p for p in repository.iterdir() if p.is_dir()):
        config_path = folder / "config.pbtxt"
        if not config_path.is_file():
            LOGGER.warning("skipping %s: no config.pbtxt", folder)
            continue
        config = parse_model_config(config_path)
        name = config.name or folder.name
        if name != folder.name:
            raise TritonSetupError(f"{config_path}: name '{name}' differs from its folder '{folder.name}'")
        if config.platform not in ("", "onnxruntime_onnx") or config.backend not in ("", "onnxruntime"):
            raise TritonSetupError(
                f"{config_path}: platform '{config.platform}' backend '{config.backend}': "
                "only ONNX models (platform onnxruntime_onnx) are served by the local Triton"
            )
        filename = config.default_model_filename or "model.onnx"
        available = [int(v.name) for v in folder.iterdir() if v.name.isdigit() and (v / filename).is_file()]
        if not available:
            LOGGER.warning("skipping model '%s': no numbered version folder holds %s", name, filename)
            continue
        inputs = _tensor_specs(config.input, "input", str(config_path))
        outputs = _tensor_specs(config.output, "output", str(config_path))
        if not inputs or not outputs:
            raise TritonSetupError(f"{config_path}: declares no input or no output")
        batching = config.HasField("dynamic_batching")
        instance_count = sum(group.count or 1 for group in config.instance_group) or 1
        for version in _selected_versions(config, available):
            specs.append(
                ModelSpec(
                    name=name,
                    version=version,
                    onnx_path=folder / str(version) / filename,
                    inputs=inputs,
                    outputs=outputs,
                    max_batch_size=int(config.max_batch_size),
                    dynamic_batching=batching,
                    preferred_batch_sizes=tuple(int(b) for b in config.dynamic_batching.preferred_batch_size),
                    max_queue_delay_us=int(config.dynamic_batching.max_queue_delay_microseconds),
                    preserve_ordering=bool(config.dynamic_batching.preserve_ordering),
                    instance_count=instance_count,
                )
            )
    return specs


# --------------------------------------------------------------------------------------------
# Pre-flight: the ONNX files loaded at start have the declared tensors
# --------------------------------------------------------------------------------------------


def check_models(specs: Sequence[ModelSpec]) -> None:
    """Open each version loaded at start as the backend will, so a wrong file is refused before Triton starts.

    Raises TritonSetupError naming the model, version, file and tensor. (Versions loaded later are
    checked the same way by the backend when a client loads them; Triton refuses the load.)
    """
    backend = _backend()
    for spec in specs:
        where = f"model '{spec.name}' version {spec.version}"
        try:
            backend.open_session(
                str(spec.onnx_path),
                [(t.name, t.dtype, t.dims) for t in spec.inputs],
                [(t.name, t.dtype, t.dims) for t in spec.outputs],
                spec.max_batch_size > 0,
                where,
            )
        except ValueError as exc:
            raise TritonSetupError(str(exc)) from None


# --------------------------------------------------------------------------------------------
# The tritonserver of the nvidia-pytriton wheel
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Distribution:
    """Where the ``nvidia-pytriton`` wheel keeps tritonserver, its Python backend and its libraries."""

    binary: Path
    python_backend: Path  # libtriton_python.so, triton_python_backend_utils.py
    stub: Path  # triton_python_backend_stub built for this interpreter's Python version
    libs: Path  # nvidia_pytriton.libs: the shared libraries the wheel bundles

    @classmethod
    def find(cls) -> "Distribution":
        spec = importlib.util.find_spec("pytriton")
        if spec is None or spec.origin is None:
            raise TritonSetupError(
                f"the nvidia-pytriton wheel is not installed for {sys.executable}: run this module with "
                ".venv-triton/bin/python (make .venv-triton/.installed)"
            )
        root = Path(spec.origin).parent / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        found = cls(
            binary=root / "bin" / "tritonserver",
            python_backend=root / "backends" / "python",
            stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
            libs=root.parent.parent / "nvidia_pytriton.libs",
        )
        for path in (found.binary, found.python_backend / "libtriton_python.so", found.stub, found.libs):
            if not path.exists():
                raise TritonSetupError(f"{path} is missing from the nvidia-pytriton wheel (Python {version})")
        return found


def prepare_backends(workspace: Path, dist: Distribution) -> Path:
    """A backend directory: the wheel's Python backend with its stub, and ``onnxruntime/model.py``.

    ``backends/python/{libtriton_python.so, triton_python_backend_utils.py,
    triton_python_backend_stub}`` (Triton's layout, the stub built for this interpreter's Python
    version, as PyTriton prepares it) and ``backends/onnxruntime/model.py``, a copy of
    :mod:`inference_workers.triton_onnx_backend`. Copies (3 MB), not links: Triton refuses a backend
    library whose real path "escapes" the backend directory.
    """
    backends = workspace / "backends"
    python = backends / "python"
    onnx = backends / ONNX_BACKEND
    python.mkdir(parents=True)
    onnx.mkdir()
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(dist.python_backend / name, python / name)
    shutil.copy2(dist.stub, python / "triton_python_backend_stub")
    shutil.copy2(BACKEND_FILE, onnx / "model.py")
    return backends


#: The header a restricted model-control API demands (``inference_workers.triton_client.CONTROL_HEADER``).
CONTROL_HEADER = "tangram-model-control"
#: Where the secured stack hands the wrapper the model-control key (never on its own command line).
CONTROL_KEY_ENV = "TANGRAM_TRITON_CONTROL_KEY"


def restricted_model_control(key: str | None) -> list[str]:
    """Flags that make Triton's model-repository API (load, unload, index) demand ``key`` in CONTROL_HEADER.

    Inference, metadata and health stay open to the processors that reach Triton; changing what it
    serves needs the key. None: unrestricted (the developer stack).
    """
    if not key:
        return []
    return [f"--grpc-restricted-protocol=model-repository:{CONTROL_HEADER}={key}",
            f"--http-restricted-api=model-repository:{CONTROL_HEADER}={key}"]


def tritonserver_command(
    binary: Path, args: argparse.Namespace, backends: Path, models: Sequence[str], shm_prefix: str,
    control_key: str | None = None,
) -> list[str]:
    """The tritonserver command line: explicit model control, ``models`` loaded at start."""
    return [
        str(binary),
        f"--model-repository={args.model_repository}",
        f"--backend-directory={backends}",
        "--model-control-mode=explicit",
        *(f"--load-model={name}" for name in models),
        # Not strict: the endpoints open only once the models loaded at start are ready (and Triton exits
        # when one fails), so "ready" means loaded; a strict server would stay unready for good after a
        # client's load of a broken version failed, while every served version still answers.
        "--strict-readiness=false",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        f"--http-address={args.host}",
        f"--http-port={args.http_port}",
        f"--grpc-address={args.host}",
        f"--grpc-port={args.grpc_port}",
        f"--metrics-address={args.host}",
        f"--metrics-port={args.metrics_port}",
        "--allow-gpu-metrics=false",
        "--pinned-memory-pool-byte-size=0",  # CPU only: no CUDA driver to pin memory with
        f"--log-verbose={args.log_verbose}",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        f"--backend-config=python,shm-default-byte-size={SHM_DEFAULT_BYTES}",
        f"--backend-config=python,shm-growth-byte-size={SHM_GROWTH_BYTES}",
        *restricted_model_control(control_key),
    ]


def tritonserver_env(dist: Distribution) -> dict[str, str]:
    """The environment of tritonserver and its stubs (as PyTriton builds it).

    ``LD_LIBRARY_PATH``: this interpreter's libpython first (:func:`ensure_own_libpython`), then the
    wheel's bundled libraries. ``PATH``: this environment's ``bin`` first, so that the stub's embedded
    interpreter finds ``python3`` there and with it this environment's site-packages (numpy,
    onnxruntime).
    """
    ensure_own_libpython()
    env = dict(os.environ)
    libraries = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*libraries, str(dist.libs)])
    env["PATH"] = os.pathsep.join([str(Path(sys.prefix) / "bin"), env.get("PATH", "")])
    return env


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when this process dies, even by SIGKILL (PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(1, signal.SIGTERM)


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="triton_server.py",
        description="Serve a Triton model repository of ONNX models with the nvidia-pytriton wheel's tritonserver "
        "on the CPU, with explicit model control.",
    )
    parser.add_argument(
        "--model-repository", type=Path, required=True, help="<model>/config.pbtxt, <model>/<version>/model.onnx"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address of the HTTP, gRPC and metrics endpoints")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver's --log-verbose level")
    parser.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for readiness")
    return parser.parse_args(argv)


def check_ports_free(host: str, ports: Sequence[int]) -> None:
    """Fail fast, with the port in the message, when another process already listens on one of them."""
    for port in ports:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise TritonSetupError(
                    f"cannot listen on {host}:{port}: {exc.strerror}; is another Triton running?"
                ) from exc


def _local_url(host: str, port: int, path: str) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}{path}" if ":" in host else f"http://{host}:{port}{path}"


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _served(args: argparse.Namespace, control_key: str | None) -> list[str]:
    """``name/version`` of every READY model version, from Triton's repository index (for the log)."""
    request = urllib.request.Request(_local_url(args.host, args.http_port, "/v2/repository/index"), data=b"{}",
                                     headers={CONTROL_HEADER: control_key} if control_key else {})
    try:
        with urllib.request.urlopen(request, timeout=5.0) as response:
            index = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return [f"(repository index unavailable: {exc})"]
    return sorted(f"{m['name']}/{m.get('version', '?')}" for m in index if m.get("state") == "READY")


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (the stubs of a tritonserver), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def stop_tritonserver(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM tritonserver and wait for it (it drains, unloads the models, stops the stubs); SIGKILL late ones."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            stubs = _children(process.pid)
            LOGGER.error("tritonserver still running %.0f s after SIGTERM: killing it and %d stub(s)",
                         STOP_GRACE_S, len(stubs))
            for pid in [process.pid, *stubs]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait(timeout=10)


def remove_shared_memory(prefix: str) -> list[str]:
    """Remove the Python backend's regions named ``prefix*`` from /dev/shm (left by a killed stub)."""
    removed = []
    for path in Path("/dev/shm").glob(f"{prefix}*"):
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    return removed


def _wait_ready(process: subprocess.Popen[bytes], args: argparse.Namespace, stop: threading.Event) -> int | None:
    """None once Triton is ready; else the exit code (1: Triton died or was too slow, 0: asked to stop)."""
    url = _local_url(args.host, args.http_port, "/v2/health/ready")
    deadline = time.monotonic() + args.startup_timeout
    while not _ready(url):
        if stop.is_set():
            return 0
        if process.poll() is not None:
            LOGGER.error("tritonserver exited with code %s while starting; see its log above", process.returncode)
            return 1
        if time.monotonic() > deadline:
            LOGGER.error("Triton not ready within %.0f s; see its log above", args.startup_timeout)
            return 1
        time.sleep(0.1)
    return None


def serve(args: argparse.Namespace) -> int:
    """Start Triton, serve until SIGTERM/SIGINT (or until Triton dies), stop it. Returns the exit code."""
    started = time.monotonic()
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        LOGGER.info("%s received, stopping Triton", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    repository = args.model_repository = args.model_repository.resolve()
    specs = discover_models(repository)
    if not specs:  # apps install their models later (`tangram apply`), loaded by explicit model control
        LOGGER.info("no model in %s yet: Triton starts empty", repository)
    check_models(specs)
    check_ports_free(args.host, (args.http_port, args.grpc_port, args.metrics_port))
    dist = Distribution.find()
    libdir = ensure_own_libpython()
    LOGGER.info("python %s, libpython from %s", sys.version.split()[0], libdir or "(static interpreter)")
    env = tritonserver_env(dist)
    workspace = Path(tempfile.mkdtemp(prefix="tangram-triton-"))
    shm_prefix = f"tangram-triton-{os.getpid()}-{secrets.token_hex(4)}-"
    models = sorted({spec.name for spec in specs})
    key = env.pop(CONTROL_KEY_ENV, None)  # on Triton's command line only; its backend stubs need not see it
    command = tritonserver_command(dist.binary, args, prepare_backends(workspace, dist), models, shm_prefix, key)
    LOGGER.info("starting %s", " ".join(command).replace(key, "<model-control key>") if key else " ".join(command))
    process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    exit_code = 0
    try:
        failed = _wait_ready(process, args, stop)
        if failed is not None:
            return failed
        LOGGER.info(
            "Triton ready in %.1f s (explicit model control): %s; HTTP %s:%d, gRPC %s:%d, metrics %s:%d",
            time.monotonic() - started, ", ".join(_served(args, key)),
            args.host, args.http_port, args.host, args.grpc_port, args.host, args.metrics_port,
        )
        while not stop.wait(0.5):
            if process.poll() is not None:
                LOGGER.error("tritonserver exited with code %s; exiting", process.returncode)
                exit_code = 1
                break
    finally:
        stopping = time.monotonic()
        try:
            stop_tritonserver(process)
        finally:  # even when tritonserver could not be reaped: nothing of this server is left behind
            shutil.rmtree(workspace, ignore_errors=True)
            if leftovers := remove_shared_memory(shm_prefix):
                LOGGER.warning("removed %d shared-memory region(s) the Python backend left: %s",
                               len(leftovers), leftovers)
        LOGGER.info("Triton stopped in %.1f s", time.monotonic() - stopping)
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        stream=sys.stdout,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    args = parse_args(argv)
    try:
        return serve(args)
    except TritonSetupError as exc:
        LOGGER.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
