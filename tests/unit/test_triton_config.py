"""The checked-in Triton model config parses as Triton's own ModelConfig and declares the anomaly contract."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from inference_workers import triton_server
from inference_workers.triton_client import ANOMALY_CONTRACT, ModelContract, TensorContract
from streams import PROJECT_ROOT

REPOSITORY = PROJECT_ROOT / "inference_workers" / "model_repository"
CONFIG = REPOSITORY / "anomaly" / "config.pbtxt"


@pytest.fixture(scope="module")
def config() -> model_config_pb2.ModelConfig:
    return text_format.Parse(CONFIG.read_text(), model_config_pb2.ModelConfig())


def test_config_is_an_onnx_model_named_after_its_folder(config: model_config_pb2.ModelConfig) -> None:
    assert config.name == "anomaly" == CONFIG.parent.name
    assert config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == 1024


def test_config_declares_the_tensors(config: model_config_pb2.ModelConfig) -> None:
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [
        ("features", model_config_pb2.TYPE_FP32, [27])
    ]
    assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [
        ("probabilities", model_config_pb2.TYPE_FP32, [3])
    ]


def test_config_declares_dynamic_batching_and_one_cpu_instance(config: model_config_pb2.ModelConfig) -> None:
    assert config.HasField("dynamic_batching")
    assert list(config.dynamic_batching.preferred_batch_size) == [64, 256, 1024]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert [(g.count, g.kind) for g in config.instance_group] == [(1, model_config_pb2.ModelInstanceGroup.KIND_CPU)]
    assert max(config.dynamic_batching.preferred_batch_size) <= config.max_batch_size


def test_the_client_contract_is_the_config(config: model_config_pb2.ModelConfig) -> None:
    """The contract the inference workers check at setup is the one the repository declares."""
    (inp,) = config.input
    (out,) = config.output
    assert ANOMALY_CONTRACT == ModelContract(
        input=TensorContract(
            inp.name, model_config_pb2.DataType.Name(inp.data_type).removeprefix("TYPE_"), tuple(inp.dims)
        ),
        output=TensorContract(
            out.name, model_config_pb2.DataType.Name(out.data_type).removeprefix("TYPE_"), tuple(out.dims)
        ),
        max_batch_size=config.max_batch_size,
    )
    assert ANOMALY_CONTRACT.input.numpy_dtype == np.float32


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
    assert spec.inputs == (triton_server.TensorSpec("features", np.dtype(np.float32), (27,)),)
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
