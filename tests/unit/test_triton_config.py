"""The checked-in Triton model config parses as Triton's own ModelConfig and declares the anomaly contract;
the local Triton reads it as declared, starts with explicit model control, and its onnxruntime backend
checks each ONNX file against it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from inference_workers import triton_server
from inference_workers.triton_client import ModelContract, TensorContract
from pm_app import FEATURE_NAMES
from reference import PM

REPOSITORY = PM / "model_repository"
CONFIG = REPOSITORY / "anomaly" / "config.pbtxt"
#: The input the config declares: the reference feature set's vector (27 window aggregates, 3 rated values).
WIDTH = len(FEATURE_NAMES)


@pytest.fixture(scope="module")
def config() -> model_config_pb2.ModelConfig:
    return text_format.Parse(CONFIG.read_text(), model_config_pb2.ModelConfig())


def test_config_is_an_onnx_model_named_after_its_folder(config: model_config_pb2.ModelConfig) -> None:
    assert config.name == "anomaly" == CONFIG.parent.name
    assert config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == 1024


def test_config_declares_the_tensors(config: model_config_pb2.ModelConfig) -> None:
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [
        ("features", model_config_pb2.TYPE_FP32, [WIDTH])
    ]
    assert WIDTH == 30
    assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [
        ("probabilities", model_config_pb2.TYPE_FP32, [3])
    ]


def test_config_declares_dynamic_batching_and_one_instance_wherever_triton_runs(
        config: model_config_pb2.ModelConfig) -> None:
    """No instance kind: NVIDIA's Triton puts the instance on each GPU it has, the local one on the CPU."""
    assert config.HasField("dynamic_batching")
    assert list(config.dynamic_batching.preferred_batch_size) == [64, 256, 1024]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert [(g.count, g.kind) for g in config.instance_group] == [(1, model_config_pb2.ModelInstanceGroup.KIND_AUTO)]
    assert max(config.dynamic_batching.preferred_batch_size) <= config.max_batch_size


def test_the_client_contract_is_read_from_the_config(config: model_config_pb2.ModelConfig) -> None:
    """The contract the inference workers check at setup is the one the app's repository declares, labels included."""
    contract = ModelContract.from_config(CONFIG.parent)
    assert contract == ModelContract(
        input=TensorContract("features", "FP32", (WIDTH,)),
        output=TensorContract("probabilities", "FP32", (3,)),
        max_batch_size=config.max_batch_size,
        labels=("healthy", "bearing_wear", "overheating"),
    )
    assert contract.input.numpy_dtype == np.float32


def test_a_model_config_a_worker_cannot_serve_is_refused_with_the_reason(tmp_path: Path) -> None:
    from streams.errors import InferenceError

    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "config.pbtxt").write_text(CONFIG.read_text().replace(
        'input [', 'input [\n  { name: "extra" data_type: TYPE_FP32 dims: [ 1 ] },', 1))
    with pytest.raises(InferenceError, match="one input and one output"):
        ModelContract.from_config(tmp_path / "two")
    (tmp_path / "nolabels").mkdir()
    (tmp_path / "nolabels" / "config.pbtxt").write_text(CONFIG.read_text())
    with pytest.raises(InferenceError, match="labels.txt"):
        ModelContract.from_config(tmp_path / "nolabels")


def test_contract_rejects_an_unknown_datatype() -> None:
    with pytest.raises(ValueError, match="FP33"):
        TensorContract("features", "FP33", (27,))


def test_the_local_server_reads_the_config_as_declared(tmp_path: Path) -> None:
    """The local CPU Triton binds what the config declares (the model file itself is not opened here)."""
    model_dir = tmp_path / "anomaly"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "3").mkdir()
    (model_dir / "config.pbtxt").write_text(CONFIG.read_text())
    (model_dir / "1" / "model.onnx").write_bytes(b"")
    (model_dir / "3" / "model.onnx").write_bytes(b"")
    (tmp_path / "not_a_model").mkdir()  # no config.pbtxt: skipped

    (spec,) = triton_server.discover_models(tmp_path)

    assert spec.name == "anomaly"
    assert spec.version == 3  # Triton's default version policy: the latest one
    assert spec.onnx_path == model_dir / "3" / "model.onnx"
    assert spec.inputs == (triton_server.TensorSpec("features", np.dtype(np.float32), (WIDTH,)),)
    assert spec.outputs == (triton_server.TensorSpec("probabilities", np.dtype(np.float32), (3,)),)
    assert spec.max_batch_size == 1024
    assert spec.dynamic_batching
    assert spec.preferred_batch_sizes == (64, 256, 1024)
    assert spec.max_queue_delay_us == 2000
    assert spec.instance_count == 1


def test_the_local_server_skips_a_model_without_its_onnx_file(tmp_path: Path) -> None:
    (tmp_path / "anomaly" / "1").mkdir(parents=True)
    (tmp_path / "anomaly" / "config.pbtxt").write_text(CONFIG.read_text())
    assert triton_server.discover_models(tmp_path) == []


def test_the_local_server_refuses_a_non_onnx_model(tmp_path: Path) -> None:
    (tmp_path / "anomaly" / "1").mkdir(parents=True)
    (tmp_path / "anomaly" / "1" / "model.onnx").write_bytes(b"")
    (tmp_path / "anomaly" / "config.pbtxt").write_text(
        CONFIG.read_text().replace('platform: "onnxruntime_onnx"', 'platform: "tensorrt_plan"')
    )
    with pytest.raises(triton_server.TritonSetupError, match="tensorrt_plan"):
        triton_server.discover_models(tmp_path)


def test_the_local_server_puts_its_own_libpython_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python-backend stub must load this interpreter's libpython, not the system's."""
    import sysconfig

    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/lib/x86_64-linux-gnu")
    libdir = triton_server.ensure_own_libpython()
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        assert libdir is None
        return
    assert libdir == sysconfig.get_config_var("LIBDIR")
    assert os.environ["LD_LIBRARY_PATH"].split(os.pathsep) == [libdir, "/usr/lib/x86_64-linux-gnu"]
    triton_server.ensure_own_libpython()  # idempotent
    assert os.environ["LD_LIBRARY_PATH"].split(os.pathsep) == [libdir, "/usr/lib/x86_64-linux-gnu"]


def test_the_local_server_starts_triton_with_explicit_model_control(tmp_path: Path) -> None:
    args = triton_server.parse_args(["--model-repository", str(tmp_path), "--grpc-port", "9001"])
    command = triton_server.tritonserver_command(Path("/bin/tritonserver"), args, tmp_path / "backends",
                                                 ["anomaly", "other"], "tangram-triton-1-ab-")
    assert command[0] == "/bin/tritonserver"
    assert "--model-control-mode=explicit" in command
    assert [c for c in command if c.startswith("--load-model=")] == ["--load-model=anomaly", "--load-model=other"]
    assert f"--model-repository={tmp_path}" in command and f"--backend-directory={tmp_path / 'backends'}" in command
    assert "--grpc-port=9001" in command and "--http-port=8000" in command
    assert "--backend-config=python,shm-region-prefix-name=tangram-triton-1-ab-" in command


def _onnx_model(path: Path, features: int = WIDTH) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = np.ones((features, 3), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["features", "W"], ["logits"]), helper.make_node("Softmax", ["logits"], ["probabilities"])],
        "anomaly",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 3])],
        initializer=[numpy_helper.from_array(weights, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_the_onnx_backend_checks_the_graph_against_the_config(tmp_path: Path) -> None:
    """The local Triton's onnxruntime backend refuses, naming the tensor, a file that is not what config.pbtxt declares."""
    from google.protobuf.json_format import MessageToDict

    from inference_workers import triton_onnx_backend as backend

    as_json = MessageToDict(triton_server.parse_model_config(CONFIG), preserving_proto_field_name=True)
    inputs, outputs = backend.declared_tensors(as_json, "input"), backend.declared_tensors(as_json, "output")
    assert inputs == [("features", np.dtype(np.float32), (WIDTH,))] and outputs == [("probabilities", np.dtype(np.float32), (3,))]

    good, narrow, wrong = tmp_path / "good.onnx", tmp_path / "narrow.onnx", tmp_path / "missing.onnx"
    _onnx_model(good)
    _onnx_model(narrow, features=WIDTH - 1)
    session = backend.open_session(str(good), inputs, outputs, True, "v1")
    assert session.run(["probabilities"], {"features": np.zeros((2, WIDTH), dtype=np.float32)})[0].shape == (2, 3)
    with pytest.raises(ValueError, match=rf"v2: input 'features' has shape \['batch', {WIDTH - 1}\].*declares \[-1, {WIDTH}\]"):
        backend.open_session(str(narrow), inputs, outputs, True, "v2")
    with pytest.raises(ValueError, match="output 'scores' is not an output of the ONNX graph"):
        backend.open_session(str(good), inputs, [("scores", np.dtype(np.float32), (3,))], True, "v3")
    with pytest.raises(ValueError, match="is tensor\\(float\\) in the ONNX graph, the config declares float64"):
        backend.open_session(str(good), [("features", np.dtype(np.float64), (WIDTH,))], outputs, True, "v4")
    with pytest.raises(ValueError, match="does not exist"):
        backend.open_session(str(wrong), inputs, outputs, True, "v5")


def test_the_onnx_backend_splits_a_dynamic_batch_back_into_its_requests() -> None:
    from inference_workers import triton_onnx_backend as backend

    merged = np.arange(12).reshape(6, 2)
    parts = backend.split_rows([merged, merged[:, :1]], [1, 3, 2])
    assert [p[0].tolist() for p in parts] == [merged[:1].tolist(), merged[1:4].tolist(), merged[4:].tolist()]
    assert [p[1].shape for p in parts] == [(1, 1), (3, 1), (2, 1)]


def test_a_contract_dimension_of_minus_one_takes_any_size_as_triton_reads_it() -> None:
    from inference_workers.triton_client import fits

    assert fits((3, 48, 320), (3, 48, -1)) and fits((3, 48, 1600), (3, 48, -1))
    assert fits((1, 544, 864), (1, -1, -1)) and fits((27,), (27,))
    assert not fits((3, 32, 320), (3, 48, -1))  # a fixed dimension still has to match
    assert not fits((3, 48), (3, 48, -1)) and not fits((26,), (27,))
