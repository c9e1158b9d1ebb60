"""The exception family of Tangram: one root, a small family per concern.

Every message tells the operator what to do next.
"""


class TangramError(Exception):
    """Root of every error Tangram raises on purpose."""


class StackError(TangramError):
    """A component of the local stack is missing, cannot start or is not ready."""


class TopologyError(TangramError):
    """A topology file is invalid or cannot be applied."""


class SchemaError(TangramError):
    """A schema is invalid, unknown or incompatible."""


class DeliveryError(TangramError):
    """Outputs were not acknowledged by the broker; offsets were not committed."""


class InferenceError(TangramError):
    """Triton refused, timed out or returned something off-contract."""


class InferenceUnavailableError(InferenceError):
    """Triton did not answer (down, overloaded, past the deadline): retry later, the records are not at fault."""


class BackpressureError(TangramError):
    """A processor cannot make progress now (a service it needs is slow or down).

    The delivery loop pauses the partitions, puts the batch back, backs off while it keeps
    polling, and retries: nothing is committed, nothing is lost, the group does not rebalance.
    """


class ServiceUnavailableError(BackpressureError):
    """A service a processor calls (Triton, Redis, the schema registry, a webhook) failed every try, or its
    circuit breaker is open (:mod:`streams.resilience`): the batch is put back and retried once it answers."""

    def __init__(self, message: str, service: str = ""):
        super().__init__(message)
        self.service = service


class StateLogError(TangramError):
    """A compacted state topic (``_tangram.models``, ``_tangram.config``) cannot be read or written."""


class ModelRegistryError(TangramError):
    """The model registry refuses a registration or a stage change (the message says why)."""


class ArtifactIntegrityError(ModelRegistryError):
    """A model artifact is missing or its sha256 digest differs from the registered one: never load it."""


class ConfigCenterError(TangramError):
    """The config center refuses a change or cannot serve a value."""


class ConfigValidationError(ConfigCenterError):
    """A config change does not match its namespace's declared schema; nothing of it was published."""


class DriftBaselineError(TangramError):
    """The training baseline of a drift job cannot be rebuilt or does not match the model card."""


class PayloadError(TangramError):
    """A payload stored by reference is missing or its content differs from its digest."""
