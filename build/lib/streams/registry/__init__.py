"""Embedded schema registry: the Confluent Schema Registry REST API over a compacted ``_schemas`` topic.

Run it with ``python -m streams.registry --host 127.0.0.1 --port 8081 --bootstrap 127.0.0.1:9092``.
"""

from streams.registry.compatibility import check, check_level
from streams.registry.store import RegistryError, SchemaRegistryState

__all__ = ["RegistryError", "SchemaRegistryState", "check", "check_level"]
