"""The inference workers' side of Triton: one model behind an asyncio gRPC client, held to a contract.

``TritonModel`` checks at ``setup()`` that the model Triton serves has the inputs and outputs the
worker was written for (the seeds' "service connectivity" step), then runs micro-batches with a
deadline on every call. Every failure is a :class:`streams.errors.InferenceError` whose message
says what differed or what did not answer; when Triton did not answer at all (down, past the
deadline) it is the subclass :class:`streams.errors.InferenceUnavailableError`, which says "retry
later, the rows are not at fault"::

    contract = ModelContract.from_config(Path("topologies/predictive_maintenance/model_repository/anomaly"))
    model = TritonModel("127.0.0.1:8001", "anomaly", contract=contract)
    await model.setup()                      # raises InferenceError on a contract mismatch
    probabilities = await model.infer(batch)  # (n, 27) float32 -> (n, 3) float32
    await model.close()

:class:`ModelRepository` is Triton's explicit model control (the model-repository API): which
versions are loaded, load a set of versions of one model side by side, unload::

    async with ModelRepository("127.0.0.1:8001") as repository:
        await repository.serve("anomaly", {"2"})     # load version 2 beside the ones Triton serves
        await repository.retire("anomaly", {"1"})    # then stop serving version 1

Both work unchanged against the local CPU Triton (``inference_workers.triton_server``) and NVIDIA's
Triton image serving the same model repository with ``--model-control-mode=explicit``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any, Self

import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import InferInput, InferRequestedOutput, model_config_pb2
from tritonclient.utils import InferenceServerException, np_to_triton_dtype, triton_to_np_dtype

from streams.errors import InferenceError, InferenceUnavailableError

LOGGER = logging.getLogger("tangram.inference.triton")

#: Default deadline of one inference call, in seconds.
DEFAULT_TIMEOUT_S = 2.0
#: Default deadline of one model load: Triton starts each instance of each version (a Python-backend
#: stub process on the local CPU Triton, about 1-2 s each here) before it answers.
DEFAULT_LOAD_TIMEOUT_S = 60.0
#: The header Triton's restricted model-repository protocol checks (``--grpc-restricted-protocol``).
CONTROL_HEADER = "tangram-model-control"


def _channel_args() -> list[tuple[str, Any]]:
    """gRPC channel options: tritonclient's defaults (message sizes, keepalive), reconnect backoff capped at 1 s.

    gRPC's own cap is 120 s: after an outage of a few tens of seconds a client could wait many seconds
    more before it even tries the restarted server.
    """
    from tritonclient.grpc import KeepAliveOptions
    from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE

    keepalive = KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


@dataclasses.dataclass(frozen=True)
class TensorContract:
    """One tensor as the worker expects it: name, Triton datatype ("FP32", ...) and dims without the batch."""

    name: str
    datatype: str
    dims: tuple[int, ...]

    def __post_init__(self) -> None:
        if triton_to_np_dtype(self.datatype) is None:
            raise ValueError(f"tensor '{self.name}': unknown Triton datatype {self.datatype!r}")
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(triton_to_np_dtype(self.datatype))


@dataclasses.dataclass(frozen=True)
class ModelContract:
    """What a worker expects of a model: one input, one output, the batching it relies on, the class labels.

    ``max_batch_size``, when set, must be what the model's config declares; when None it is only
    required to be positive (a batching model), and the served value is used to split batches.
    """

    input: TensorContract
    output: TensorContract
    max_batch_size: int | None = None
    labels: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, model_dir: Path) -> "ModelContract":
        """The contract a model declares in its app's repository: ``config.pbtxt`` (one input, one output,
        ``max_batch_size``) and the output's ``label_filename`` (one label per line; else "0", "1", ...)."""
        from google.protobuf import text_format

        path = Path(model_dir) / "config.pbtxt"
        try:
            config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        except (OSError, text_format.ParseError) as exc:
            raise InferenceError(f"model config {path}: {exc}") from exc
        if len(config.input) != 1 or len(config.output) != 1:
            raise InferenceError(f"model config {path}: a worker's model has one input and one output, "
                                 f"not {len(config.input)} and {len(config.output)}")

        def tensor(t: Any) -> TensorContract:
            return TensorContract(t.name, model_config_pb2.DataType.Name(t.data_type).removeprefix("TYPE_"), tuple(t.dims))

        output = config.output[0]
        if output.label_filename:
            labels_path = path.parent / output.label_filename
            try:
                labels = tuple(line.strip() for line in labels_path.read_text().splitlines() if line.strip())
            except OSError as exc:
                raise InferenceError(f"model config {path}: labels of output {output.name!r}: {exc}") from exc
        else:
            labels = tuple(str(i) for i in range(output.dims[-1] if output.dims else 1))
        return cls(tensor(config.input[0]), tensor(output), int(config.max_batch_size) or None, labels)


def _error(label: str, timeout_s: float, action: str, exc: InferenceServerException) -> InferenceError:
    """Triton's error as an InferenceError; "did not answer" (down, past the deadline) as InferenceUnavailableError."""
    status = exc.status() or ""
    message = (exc.message() or "").split("\n\nAt:")[0].strip()  # a Python backend error carries its traceback
    if "DEADLINE_EXCEEDED" in status:
        return InferenceUnavailableError(f"{label}: {action} did not answer within {timeout_s:g} s (deadline exceeded)")
    if "UNAVAILABLE" in status:
        return InferenceUnavailableError(
            f"{label}: Triton is unavailable during {action} ({message}); is the model server running (`tangram up`)?"
        )
    return InferenceError(f"{label}: {action} failed: {status} {message}".strip())


def fits(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    """Whether a tensor's ``shape`` (without the batch dimension) is one the ``dims`` of a config allow:
    the same rank, and every dimension equal where the config fixes it (-1: any size, as Triton reads it)."""
    return len(shape) == len(dims) and all(d < 0 or s == d for s, d in zip(shape, dims))


def _dims(values: Any) -> list[int]:
    return [int(v) for v in values]


class TritonModel:
    """One model version served by Triton, called over gRPC (asyncio) with a deadline on every call."""

    def __init__(
        self,
        url: str,
        model_name: str,
        model_version: str = "",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        contract: ModelContract,
    ) -> None:
        """``url`` is Triton's gRPC endpoint ``host:port``; ``model_version`` "" means the one Triton picks."""
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.url = url
        self.model_name = model_name
        self.model_version = model_version
        self.timeout_s = timeout_s
        self.contract = contract
        self.max_batch_size: int | None = None
        self._client: grpcclient.InferenceServerClient | None = None

    @property
    def _label(self) -> str:
        version = f" version {self.model_version}" if self.model_version else ""
        return f"model '{self.model_name}'{version} at {self.url}"

    def _grpc(self) -> grpcclient.InferenceServerClient:
        # Created lazily, inside the running event loop that will use it.
        if self._client is None:
            self._client = grpcclient.InferenceServerClient(self.url, channel_args=_channel_args())
        return self._client

    def _error(self, action: str, exc: InferenceServerException) -> InferenceError:
        return _error(self._label, self.timeout_s, action, exc)

    async def is_ready(self) -> bool:
        """True when Triton answers and this model version is ready; never raises.

        Triton's liveness and the version's own readiness, not the server's readiness: a Triton with
        strict readiness (NVIDIA's default) reports itself unready for good after any failed model
        load, even while this version answers.
        """
        try:
            client = self._grpc()
            return bool(
                await client.is_server_live(client_timeout=self.timeout_s)
                and await client.is_model_ready(self.model_name, self.model_version, client_timeout=self.timeout_s)
            )
        except (InferenceServerException, OSError):
            return False

    async def setup(self) -> None:
        """Read the model's metadata and config and check them against the contract.

        Raises InferenceError naming the first field that differs, e.g.
        ``input 'features' dims [26] != declared [27]``, or saying why Triton did not answer.
        """
        client = self._grpc()
        try:
            metadata = await client.get_model_metadata(
                self.model_name, self.model_version, client_timeout=self.timeout_s
            )
            config_response = await client.get_model_config(
                self.model_name, self.model_version, client_timeout=self.timeout_s
            )
        except InferenceServerException as exc:
            raise self._error("reading the model's metadata and config", exc) from None
        config = config_response.config
        self._check(metadata, config)
        self.max_batch_size = int(config.max_batch_size)
        LOGGER.info(
            "%s matches its contract: %s %s%s -> %s %s%s, max_batch_size %d",
            self._label,
            self.contract.input.name,
            self.contract.input.datatype,
            list(self.contract.input.dims),
            self.contract.output.name,
            self.contract.output.datatype,
            list(self.contract.output.dims),
            self.max_batch_size,
        )

    def _check(self, metadata: Any, config: Any) -> None:
        contract = self.contract
        if contract.max_batch_size is not None and config.max_batch_size != contract.max_batch_size:
            raise InferenceError(
                f"{self._label}: max_batch_size {config.max_batch_size} != declared {contract.max_batch_size}"
            )
        if config.max_batch_size <= 0:
            raise InferenceError(f"{self._label}: max_batch_size {config.max_batch_size}: the model does not batch")
        for kind, expected, configured, served in (
            ("input", contract.input, config.input, metadata.inputs),
            ("output", contract.output, config.output, metadata.outputs),
        ):
            by_name = {t.name: t for t in configured}
            tensor = by_name.get(expected.name)
            if tensor is None:
                raise InferenceError(f"{self._label}: has no {kind} '{expected.name}' (its {kind}s: {sorted(by_name)})")
            datatype = model_config_pb2.DataType.Name(tensor.data_type).removeprefix("TYPE_")
            if datatype != expected.datatype:
                raise InferenceError(
                    f"{self._label}: {kind} '{expected.name}' datatype {datatype} != declared {expected.datatype}"
                )
            if _dims(tensor.dims) != list(expected.dims):
                raise InferenceError(
                    f"{self._label}: {kind} '{expected.name}' dims {_dims(tensor.dims)} != declared {list(expected.dims)}"
                )
            # The metadata is what the inference endpoint enforces: [-1, *dims] for a batching model.
            shapes = {t.name: _dims(t.shape) for t in served}
            if shapes.get(expected.name) != [-1, *expected.dims]:
                raise InferenceError(
                    f"{self._label}: {kind} '{expected.name}' served shape {shapes.get(expected.name)} "
                    f"!= declared {[-1, *expected.dims]}"
                )

    async def infer(self, batch: np.ndarray) -> np.ndarray:
        """Run one batch (rows × input dims) and return the output (rows × output dims).

        A batch larger than the model's max_batch_size is split and its parts sent concurrently.
        Each call has a deadline of ``timeout_s``; a timeout, an unavailable server or a refused
        request raises InferenceError.
        """
        expected = self.contract.input
        if not fits(batch.shape[1:], expected.dims):
            raise InferenceError(
                f"{self._label}: batch shape {list(batch.shape)} does not fit input '{expected.name}' dims {list(expected.dims)}"
            )
        if batch.shape[0] == 0:
            return np.empty((0, *(max(d, 0) for d in self.contract.output.dims)), dtype=self.contract.output.numpy_dtype)
        batch = np.ascontiguousarray(batch, dtype=expected.numpy_dtype)
        limit = self.max_batch_size or batch.shape[0]
        if batch.shape[0] <= limit:
            return await self._infer_one(batch)
        parts = [batch[i : i + limit] for i in range(0, batch.shape[0], limit)]
        return np.concatenate(await asyncio.gather(*(self._infer_one(part) for part in parts)))

    async def _infer_one(self, batch: np.ndarray) -> np.ndarray:
        tensor = InferInput(self.contract.input.name, list(batch.shape), np_to_triton_dtype(batch.dtype))
        tensor.set_data_from_numpy(batch)
        try:
            result = await self._grpc().infer(
                self.model_name,
                [tensor],
                model_version=self.model_version,
                outputs=[InferRequestedOutput(self.contract.output.name)],
                client_timeout=self.timeout_s,
            )
        except InferenceServerException as exc:
            raise self._error(f"inference of {batch.shape[0]} rows", exc) from None
        output = result.as_numpy(self.contract.output.name)
        if output is None or output.shape[:1] != batch.shape[:1] or not fits(output.shape[1:], self.contract.output.dims):
            raise InferenceError(
                f"{self._label}: output '{self.contract.output.name}' shape "
                f"{None if output is None else list(output.shape)} != expected {[batch.shape[0], *self.contract.output.dims]}"
            )
        return output

    async def close(self) -> None:
        """Close the gRPC channel; the object can be set up again afterwards."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    async def __aenter__(self) -> Self:
        await self.setup()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


@dataclasses.dataclass(frozen=True)
class VersionState:
    """One row of Triton's repository index: a version of a model and its state.

    ``state`` is Triton's: READY, LOADING, UNLOADING or UNAVAILABLE (``reason`` says why, e.g.
    "unloaded" or the error of a failed load).
    """

    model: str
    version: str
    state: str
    reason: str = ""


class ModelRepository:
    """Triton's explicit model control over gRPC (asyncio): the repository index, load, unload.

    Triton loads a model with the versions its version policy selects. :meth:`load` with ``versions``
    reloads the model with the config Triton serves for it and ``version_policy: {specific:
    {versions: [...]}}``: Triton loads the versions it does not have, keeps answering the ones it has
    until their replacements are ready, then unloads those not in the set; a load that fails leaves
    the versions served before as they were. The override is the whole served config, not only the
    policy: Triton takes a config override as the model's complete config, so a policy alone would
    drop the inputs, outputs and batching that ``config.pbtxt`` declares.

    Every call has a deadline (``timeout_s``; ``load_timeout_s`` for a load); a server that does not
    answer raises InferenceUnavailableError, a refused load InferenceError with Triton's reason.

    A Triton that restricts its model-repository protocol (``--grpc-restricted-protocol``, the
    secured stack) wants ``control_key`` in the ``tangram-model-control`` header of those calls.
    """

    def __init__(
        self, url: str, timeout_s: float = DEFAULT_TIMEOUT_S, load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
        *, control_key: str | None = None,
    ) -> None:
        if timeout_s <= 0 or load_timeout_s <= 0:
            raise ValueError("timeout_s and load_timeout_s must be positive")
        self.url = url
        self.timeout_s = timeout_s
        self.load_timeout_s = load_timeout_s
        # Triton's gRPC endpoint names a restricted protocol's header with this prefix
        self.headers = {f"triton-grpc-protocol-{CONTROL_HEADER}": control_key} if control_key else None
        self._client: grpcclient.InferenceServerClient | None = None

    def _grpc(self) -> grpcclient.InferenceServerClient:
        if self._client is None:
            self._client = grpcclient.InferenceServerClient(self.url, channel_args=_channel_args())
        return self._client

    def _error(self, model: str | None, action: str, exc: InferenceServerException, timeout_s: float) -> InferenceError:
        label = f"model '{model}' at {self.url}" if model else f"Triton at {self.url}"
        error = _error(label, timeout_s, action, exc)
        if "not allowed" in str(error):
            return InferenceError(f"{error}; explicit model control needs Triton started with "
                                  "--model-control-mode=explicit")
        if "must be available under the version policy" in str(error):
            return InferenceError(f"{error} (is every version asked for a folder of Triton's model repository?)")
        return error

    async def index(self) -> list[VersionState]:
        """Every model version Triton knows of (loaded, loading, unloaded, failed), with its state."""
        try:
            response = await self._grpc().get_model_repository_index(as_json=True, headers=self.headers,
                                                                   client_timeout=self.timeout_s)
        except InferenceServerException as exc:
            raise self._error(None, "reading the repository index", exc, self.timeout_s) from None
        return [
            VersionState(m["name"], str(m.get("version", "")), m.get("state", ""), m.get("reason", ""))
            for m in response.get("models", [])
        ]

    async def ready_versions(self, model: str) -> set[str]:
        """The versions of ``model`` Triton serves now (state READY)."""
        return {v.version for v in await self.index() if v.model == model and v.state == "READY"}

    async def load(self, model: str, versions: Collection[str | int] | None = None) -> None:
        """Load ``model`` with exactly ``versions`` (None: with the repository's own config and policy).

        Returns once Triton answers that the load is done and every version asked for is READY;
        raises InferenceError with Triton's reason otherwise (a version folder that does not exist,
        an ONNX file the backend refuses), after which Triton still serves what it served before.
        """
        wanted = sorted({int(v) for v in versions}) if versions is not None else None
        action = f"loading versions {wanted}" if wanted is not None else "loading"
        config = None
        if wanted is not None:
            if not wanted:
                raise ValueError(f"model '{model}': load at least one version (unload() unloads the model)")
            config = await self._served_config(model)
            config["version_policy"] = {"specific": {"versions": wanted}}
        try:
            await self._grpc().load_model(
                model, config=None if config is None else json.dumps(config), headers=self.headers,
                client_timeout=self.load_timeout_s,
            )
        except InferenceServerException as exc:
            raise self._error(model, action, exc, self.load_timeout_s) from None
        if wanted is not None:
            states = {v.version: v for v in await self.index() if v.model == model}
            missing = [states.get(str(v), VersionState(model, str(v), "UNKNOWN")) for v in wanted]
            missing = [v for v in missing if v.state != "READY"]
            if missing:
                raise InferenceError(f"model '{model}' at {self.url}: {action}: "
                                     + "; ".join(f"version {v.version} is {v.state} {v.reason}".strip() for v in missing))
        LOGGER.info("model '%s' at %s: loaded%s", model, self.url, f" versions {wanted}" if wanted else "")

    async def _served_config(self, model: str) -> dict[str, Any]:
        """The config Triton serves for ``model`` (JSON); a model not loaded is loaded first, as the repository declares it."""
        client = self._grpc()
        try:
            return (await client.get_model_config(model, as_json=True, client_timeout=self.timeout_s))["config"]
        except InferenceServerException as exc:
            if "unknown model" not in (exc.message() or ""):  # Triton down, or another refusal
                raise self._error(model, "reading its config", exc, self.timeout_s) from None
        await self.load(model)  # not loaded (or unloaded): Triton reads config.pbtxt
        try:
            return (await client.get_model_config(model, as_json=True, client_timeout=self.timeout_s))["config"]
        except InferenceServerException as exc:
            raise self._error(model, "reading its config", exc, self.timeout_s) from None

    async def unload(self, model: str) -> None:
        """Unload every version of ``model`` (Triton finishes the requests in flight first)."""
        try:
            await self._grpc().unload_model(model, headers=self.headers, client_timeout=self.timeout_s)
        except InferenceServerException as exc:
            raise self._error(model, "unloading", exc, self.timeout_s) from None
        LOGGER.info("model '%s' at %s: unloaded", model, self.url)

    async def serve(self, model: str, versions: Collection[str | int]) -> set[str]:
        """Make Triton serve ``versions`` of ``model`` beside the versions it serves now ("load the new").

        No request when they are all READY already. Returns the versions that were loaded.
        """
        wanted = {str(int(v)) for v in versions}
        ready = await self.ready_versions(model)
        if wanted <= ready:
            return set()
        await self.load(model, ready | wanted)
        return wanted - ready

    async def retire(self, model: str, versions: Collection[str | int]) -> set[str]:
        """Stop serving ``versions`` of ``model``, keeping every other version Triton serves ("unload the old").

        When no version would be left the model is unloaded. Returns the versions retired.
        """
        ready = await self.ready_versions(model)
        gone = {str(int(v)) for v in versions} & ready
        if not gone:
            return set()
        if keep := ready - gone:
            await self.load(model, keep)
        else:
            await self.unload(model)
        return gone

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()
