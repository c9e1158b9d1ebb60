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
