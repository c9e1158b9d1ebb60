"""The ingest gateway (seed node 1): producers that cannot write Avro to Kafka reach the contracts.

* ``http``: ``POST /v1/streams/{stream}/events`` (aiohttp), JSON, single or batch;
* ``mqtt``: an adapter subscribed to an MQTT broker (Mosquitto) forwarding device telemetry;
* the Kafka path is the ``streams.ingest.IngestValidator`` processor.

All three share ``streams.ingest.Validator``. A stream is declared under ``gateways:`` in the
topology and shares an ingest processor's rules, output topic and DLQ (:class:`IngestStream`).
Accepted readings are written as Avro with an idempotent producer (``KafkaSink``) and a caller
hears "accepted" only after the broker acknowledged them.
"""

from streams.gateway.errors import GatewayError
from streams.gateway.sink import KafkaSink
from streams.gateway.stream import IngestStream

__all__ = ["GatewayError", "IngestStream", "KafkaSink"]
