"""Errors of the ingest gateway."""

from streams.errors import TangramError


class GatewayError(TangramError):
    """A gateway cannot start (unknown stream, broker or registry unreachable) or lost a delivery."""
