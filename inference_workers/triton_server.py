"""The local model server: a real Triton Inference Server on the CPU, serving a Triton model repository.

Run it with the interpreter of the model-server environment (``.venv-triton``, numpy<2) from the
project root::

    .venv-triton/bin/python -m inference_workers.triton_server \\
        --model-repository inference_workers/model_repository \\
        --host 127.0.0.1 --http-port 8000 --grpc-port 8001 --metrics-port 8002

Every model folder of the repository that holds a ``config.pbtxt`` and a numbered version folder
with a ``model.onnx`` is served under the same name and version, with the same inputs, outputs,
shapes, ``max_batch_size``, dynamic batching (preferred sizes, max queue delay) and instance
count as its ``config.pbtxt`` declares. The tritonserver binary is the one that the
``nvidia-pytriton`` wheel ships; each model runs its ONNX file with onnxruntime (one session per
model version, one intra-op thread) behind PyTriton's Python backend. So the local CPU Triton
serves the contract that NVIDIA's Triton image serves from the same repository with its ONNX
Runtime backend: same names, datatypes, shapes and batching (only the metadata's ``platform``
says "python" here where the image says "onnxruntime_onnx").

Readiness is Triton's own ``GET /v2/health/ready``: the models are in Triton's repository when
the server starts, so it turns ready only once every model is loaded. (PyTriton then connects its
inference threads, ~0.5 s; a request in that window waits for them, it is not refused.) SIGTERM or SIGINT stops
the server, the Python-backend stubs and the inference threads, then the process exits 0.

This module imports only the standard library, numpy, onnxruntime and PyTriton (with the
tritonclient and protobuf that PyTriton brings), never the application's packages.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

LOGGER = logging.getLogger("tangram.triton")


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
    """One version of one model of the repository, ready to bind into Triton."""

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

    PyTriton's Python-backend stub links ``libpython3.11.so``. Without this, the dynamic loader finds
    the system's libpython instead of this interpreter's (pyenv's, here), and the stub dies with
    ``'_thread.RLock' object has no attribute '_recursion_count'``. PyTriton copies ``os.environ``
    when it starts tritonserver, so setting it here, before Triton starts, is enough.

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
    """Every servable model version of the repository, sorted by name then version.

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
# Running the ONNX models
# --------------------------------------------------------------------------------------------


def open_session(spec: ModelSpec) -> Any:
    """An onnxruntime session (CPU, one intra-op thread) checked against the declared contract."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    try:
        session = ort.InferenceSession(str(spec.onnx_path), sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/... classes
        raise TritonSetupError(f"{spec.onnx_path}: onnxruntime cannot load it: {exc}") from exc
    where = f"model '{spec.name}' version {spec.version}"
    onnx_inputs = {i.name for i in session.get_inputs()}
    onnx_outputs = {o.name for o in session.get_outputs()}
    for tensor in spec.inputs:
        if tensor.name not in onnx_inputs:
            raise TritonSetupError(
                f"{where}: input '{tensor.name}' is not an input of the ONNX graph {sorted(onnx_inputs)}"
            )
    for tensor in spec.outputs:
        if tensor.name not in onnx_outputs:
            raise TritonSetupError(
                f"{where}: output '{tensor.name}' is not an output of the ONNX graph {sorted(onnx_outputs)}"
            )
    return session


def make_infer_func(spec: ModelSpec, session: Any) -> Callable[..., dict[str, np.ndarray]]:
    """The PyTriton inference callable of one model: runs the ONNX session on the whole batch."""
    from pytriton.decorators import batch

    input_names = [t.name for t in spec.inputs]
    output_names = [t.name for t in spec.outputs]
    input_dtypes = {t.name: t.dtype for t in spec.inputs}

    def run(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        feeds = {name: np.ascontiguousarray(inputs[name], dtype=input_dtypes[name]) for name in input_names}
        results = session.run(output_names, feeds)
        return dict(zip(output_names, results))

    if spec.max_batch_size > 0:
        return batch(run)

    def unbatched(requests: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        return [run(**request) for request in requests]

    return unbatched


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


def build_triton(args: argparse.Namespace, specs: Sequence[ModelSpec], workspace: Path | None = None) -> Any:
    """A PyTriton ``Triton`` on the given host/ports with every model bound (not started yet)."""
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonLifecyclePolicy

    config = TritonConfig(
        http_address=args.host,
        http_port=args.http_port,
        grpc_address=args.host,
        grpc_port=args.grpc_port,
        metrics_address=args.host,
        metrics_port=args.metrics_port,
        allow_gpu_metrics=False,
        strict_readiness=True,
        exit_timeout_secs=5,
        log_verbose=args.log_verbose,
    )
    # The models are written into Triton's repository before the server starts, so Triton loads
    # them at startup and /v2/health/ready turns true only once they are loaded (with the default
    # policy PyTriton loads them through the API after the server is already "ready").
    policy = TritonLifecyclePolicy(launch_triton_on_startup=False, local_model_store=True)
    triton = Triton(config=config, workspace=workspace, triton_lifecycle_policy=policy)
    for spec in specs:
        session = open_session(spec)
        infer_func = make_infer_func(spec, session)
        batcher = (
            DynamicBatcher(
                max_queue_delay_microseconds=spec.max_queue_delay_us,
                preferred_batch_size=list(spec.preferred_batch_sizes) or None,
                preserve_ordering=spec.preserve_ordering,
            )
            if spec.dynamic_batching
            else None
        )
        triton.bind(
            model_name=spec.name,
            model_version=spec.version,
            infer_func=[infer_func] * spec.instance_count,
            inputs=[Tensor(name=t.name, dtype=t.dtype.type, shape=t.dims) for t in spec.inputs],
            outputs=[Tensor(name=t.name, dtype=t.dtype.type, shape=t.dims) for t in spec.outputs],
            config=ModelConfig(
                batching=spec.max_batch_size > 0,
                max_batch_size=max(spec.max_batch_size, 0),
                batcher=batcher,
            ),
            strict=True,
        )
        LOGGER.info(
            "bound model '%s' version %d from %s: inputs %s, outputs %s, max_batch_size %d, "
            "dynamic batching %s (preferred %s, max queue delay %d us), %d instance(s)",
            spec.name,
            spec.version,
            spec.onnx_path,
            [(t.name, t.dtype.name, list(t.dims)) for t in spec.inputs],
            [(t.name, t.dtype.name, list(t.dims)) for t in spec.outputs],
            spec.max_batch_size,
            "on" if spec.dynamic_batching else "off",
            list(spec.preferred_batch_sizes),
            spec.max_queue_delay_us,
            spec.instance_count,
        )
    return triton


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m inference_workers.triton_server",
        description="Serve a Triton model repository of ONNX models with PyTriton's tritonserver on the CPU.",
    )
    parser.add_argument(
        "--model-repository", type=Path, required=True, help="<model>/config.pbtxt, <model>/<version>/model.onnx"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address of the HTTP, gRPC and metrics endpoints")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver's --log-verbose level")
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


def _tritonserver_exited(triton: Any) -> bool:
    # PyTriton offers no public "has the tritonserver process died" while it is still starting;
    # its TritonServer handle (nvidia-pytriton is pinned in requirements-triton.txt) does.
    server = getattr(triton, "_triton_server", None)
    return server is not None and not server.is_alive()


def serve(args: argparse.Namespace) -> int:
    """Start Triton, serve until SIGTERM/SIGINT (or until Triton dies), stop it. Returns the exit code."""
    started = time.monotonic()
    libdir = ensure_own_libpython()
    LOGGER.info("python %s, libpython from %s", sys.version.split()[0], libdir or "(static interpreter)")

    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        LOGGER.info("%s received, stopping Triton", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    specs = discover_models(args.model_repository.resolve())
    if not specs:
        LOGGER.error(
            "no servable model in %s (need <model>/config.pbtxt and <model>/<n>/model.onnx)", args.model_repository
        )
        return 2
    check_ports_free(args.host, (args.http_port, args.grpc_port, args.metrics_port))
    scratch = Path(tempfile.mkdtemp(prefix="tangram-triton-"))
    triton = build_triton(args, specs, workspace=scratch / "workspace")

    # PyTriton waits two minutes for a tritonserver that died while starting; a watcher sees it at
    # once. tritonserver must be started from the main thread: PyTriton starts it with
    # PR_SET_PDEATHSIG, which fires when the *thread* that started it ends.
    starting = threading.Event()
    starting.set()

    def watch_startup() -> None:
        while starting.is_set():
            if _tritonserver_exited(triton):
                time.sleep(0.5)  # let PyTriton log the server's last lines
                if starting.is_set():
                    running = getattr(getattr(triton, "_triton_server", None), "_tritonserver_running_cmd", None)
                    LOGGER.error("tritonserver exited while starting (exit code %s); see its log above",
                                 getattr(running, "exit_code", "unknown"))
                    # PyTriton's stop() would wait for run(), which waits for a dead server.
                    shutil.rmtree(scratch, ignore_errors=True)
                    logging.shutdown()
                    os._exit(1)
            time.sleep(0.2)

    threading.Thread(target=watch_startup, name="triton-startup-watch", daemon=True).start()
    exit_code = 0
    try:
        try:
            triton.run()  # starts tritonserver, waits for it and every model to be ready
        except Exception as exc:  # noqa: BLE001 - PyTriton raises its own classes and TimeoutError
            LOGGER.error("Triton did not start: %s", exc)
            return 1
        finally:
            starting.clear()
        LOGGER.info(
            "Triton ready in %.1f s: models %s; HTTP %s:%d, gRPC %s:%d, metrics %s:%d",
            time.monotonic() - started,
            [f"{s.name}/{s.version}" for s in specs],
            args.host,
            args.http_port,
            args.host,
            args.grpc_port,
            args.host,
            args.metrics_port,
        )
        while not stop.wait(1.0):
            if not triton.is_alive():
                LOGGER.error("Triton or one of its models died; exiting")
                exit_code = 1
                break
    finally:
        stopping = time.monotonic()
        triton.stop()
        shutil.rmtree(scratch, ignore_errors=True)
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
