"""The local Triton's ``onnxruntime`` backend: ONNX models run by onnxruntime inside Triton's Python backend.

The ``tritonserver`` binary that the ``nvidia-pytriton`` wheel ships has the Python backend only.
Triton also loads a *Python-based backend*: a ``model.py`` found at
``<backend-directory>/<backend name>/model.py`` serves every model whose config names that backend
(Triton's documented mechanism, see "Python-based Backends" in Triton's backend docs).
:mod:`inference_workers.triton_server` installs this file as ``backends/onnxruntime/model.py``, so a
model whose ``config.pbtxt`` says ``platform: "onnxruntime_onnx"`` (backend ``onnxruntime``) is
served from the repository as it is, the way NVIDIA's image serves it with its C++ ONNX Runtime
backend: same names, datatypes, shapes, ``max_batch_size``, dynamic batcher, instance groups and
version policy, because Triton itself reads the config and runs the batcher and the instances.

Each instance of each model version is one Python-backend stub process; it opens
``<model>/<version>/<default_model_filename or model.onnx>`` with onnxruntime on the CPU (one
intra-op thread: the instance count is the parallelism, as the config declares it), and each
``execute`` runs all requests of one dynamic batch in a single ``session.run``.

This file runs inside the stub (it imports only the standard library, numpy, onnxruntime and the
stub's ``triton_python_backend_utils``); its session check is also the server's pre-flight check.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Triton config datatypes the backend serves: numpy dtype and onnxruntime's element type.
DATATYPES: dict[str, tuple[np.dtype, str]] = {
    "TYPE_BOOL": (np.dtype(np.bool_), "tensor(bool)"),
    "TYPE_UINT8": (np.dtype(np.uint8), "tensor(uint8)"),
    "TYPE_UINT16": (np.dtype(np.uint16), "tensor(uint16)"),
    "TYPE_UINT32": (np.dtype(np.uint32), "tensor(uint32)"),
    "TYPE_UINT64": (np.dtype(np.uint64), "tensor(uint64)"),
    "TYPE_INT8": (np.dtype(np.int8), "tensor(int8)"),
    "TYPE_INT16": (np.dtype(np.int16), "tensor(int16)"),
    "TYPE_INT32": (np.dtype(np.int32), "tensor(int32)"),
    "TYPE_INT64": (np.dtype(np.int64), "tensor(int64)"),
    "TYPE_FP16": (np.dtype(np.float16), "tensor(float16)"),
    "TYPE_FP32": (np.dtype(np.float32), "tensor(float)"),
    "TYPE_FP64": (np.dtype(np.float64), "tensor(double)"),
}

#: One declared tensor: name, numpy dtype, dims without the batch dimension.
Tensor = tuple[str, np.dtype, tuple[int, ...]]


def _ort_type(dtype: np.dtype) -> str | None:
    return next((ort for np_dtype, ort in DATATYPES.values() if np_dtype == dtype), None)


def _check_tensors(kind: str, declared: Sequence[Tensor], graph: Sequence[Any], batching: bool, where: str) -> None:
    by_name = {node.name: node for node in graph}
    for name, dtype, dims in declared:
        node = by_name.get(name)
        if node is None:
            raise ValueError(f"{where}: {kind} '{name}' is not an {kind} of the ONNX graph {sorted(by_name)}")
        if node.type != _ort_type(dtype):
            raise ValueError(f"{where}: {kind} '{name}' is {node.type} in the ONNX graph, the config declares {dtype.name}")
        if node.shape is None:  # a graph without shape information: onnxruntime checks at run time
            continue
        shape = list(node.shape)
        expected = [-1, *dims] if batching else list(dims)
        if len(shape) != len(expected) or any(
            isinstance(got, int) and want >= 0 and got != want for got, want in zip(shape, expected)
        ):
            raise ValueError(f"{where}: {kind} '{name}' has shape {shape} in the ONNX graph, "
                             f"the config declares {expected} (-1: the batch dimension)")


def open_session(path: str, inputs: Sequence[Tensor], outputs: Sequence[Tensor], batching: bool, where: str) -> Any:
    """An onnxruntime CPU session (one intra-op thread) whose graph has the declared inputs and outputs.

    Raises ValueError naming the file, the tensor and what differs.
    """
    import onnxruntime as ort

    if not os.path.isfile(path):
        raise ValueError(f"{where}: {path} does not exist")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    try:
        session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidProtobuf/... classes
        raise ValueError(f"{where}: onnxruntime cannot load {path}: {exc}") from None
    _check_tensors("input", inputs, session.get_inputs(), batching, where)
    _check_tensors("output", outputs, session.get_outputs(), batching, where)
    return session


def declared_tensors(config: dict, kind: str) -> list[Tensor]:
    """The ``input`` or ``output`` tensors of a model config (Triton's JSON form)."""
    tensors = []
    for tensor in config.get(kind, []):
        datatype = tensor.get("data_type", "TYPE_INVALID")
        if datatype not in DATATYPES:
            raise ValueError(f"model '{config.get('name')}': {kind} '{tensor.get('name')}': "
                             f"data_type {datatype} is not served by the local onnxruntime backend")
        tensors.append((tensor["name"], DATATYPES[datatype][0], tuple(int(d) for d in tensor.get("dims", []))))
    return tensors


def split_rows(results: Sequence[np.ndarray], sizes: Sequence[int]) -> list[list[np.ndarray]]:
    """Cut each of ``results`` (batch-major) into consecutive parts of ``sizes`` rows: one list per request."""
    bounds = np.cumsum([0, *sizes])
    return [[result[bounds[i] : bounds[i + 1]] for result in results] for i in range(len(sizes))]


class TritonPythonModel:
    """One instance of one model version, as Triton's Python backend drives it."""

    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils  # provided by the stub

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        where = f"model '{args['model_name']}' version {args['model_version']}"
        filename = config.get("default_model_filename") or "model.onnx"
        path = os.path.join(args["model_repository"], args["model_version"], filename)
        self.batching = int(config.get("max_batch_size", 0)) > 0
        self.inputs = declared_tensors(config, "input")
        self.outputs = declared_tensors(config, "output")
        self.session = open_session(path, self.inputs, self.outputs, self.batching, where)
        self.input_names = [name for name, _, _ in self.inputs]
        self.output_names = [name for name, _, _ in self.outputs]
        self.output_dtypes = [dtype for _, dtype, _ in self.outputs]

    def _run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        results = self.session.run(self.output_names, feeds)
        return [np.ascontiguousarray(r, dtype=d) for r, d in zip(results, self.output_dtypes)]

    def _response(self, arrays: Sequence[np.ndarray]) -> Any:
        return self.pb.InferenceResponse([self.pb.Tensor(n, a) for n, a in zip(self.output_names, arrays)])

    def _error(self, exc: Exception) -> Any:
        return self.pb.InferenceResponse(error=self.pb.TritonError(f"onnxruntime: {exc}"))

    def execute(self, requests: list[Any]) -> list[Any]:
        """One response per request; the requests of a dynamic batch run as one ``session.run``.

        When the merged run fails, each request runs alone, so one bad request never fails the
        others that Triton's batcher put in the same batch.
        """
        feeds = [
            {name: self.pb.get_input_tensor_by_name(request, name).as_numpy() for name in self.input_names}
            for request in requests
        ]
        if self.batching and len(feeds) > 1:
            merged = {name: np.concatenate([f[name] for f in feeds]) for name in self.input_names}
            try:
                results = self._run(merged)
            except Exception:  # noqa: BLE001 - answered request by request below
                pass
            else:
                sizes = [len(f[self.input_names[0]]) for f in feeds]
                return [self._response(part) for part in split_rows(results, sizes)]
        responses = []
        for feed in feeds:
            try:
                responses.append(self._response(self._run(feed)))
            except Exception as exc:  # noqa: BLE001 - becomes this request's error response
                responses.append(self._error(exc))
        return responses

    def finalize(self) -> None:
        self.session = None
