"""``IngestStream``: one gateway stream, built from the topology's ``gateways:`` section.

It binds the shared ``Validator`` (rules from the ingest processor's ``params``, overridden by
the gateway's own), the output codec and topics, and turns verdicts into Kafka outputs:
accepted readings as Avro on the ingest topic, rejected ones as dead letters on the DLQ.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from streams.avro import AvroCodec, codec
from streams.delivery import Output, Record, dead_letter
from streams.gateway.errors import GatewayError
from streams.ingest import H_CLIENT_ID, IngestSettings, Rejected, Validator, ingest_headers
from streams.settings import StackSettings
from streams.topology import Topology


@dataclass
class IngestStream:
    """What a gateway needs to accept readings of one declared stream."""

    name: str
    validator: Validator
    codec: AvroCodec
    output_topic: str
    dlq_topic: str

    @classmethod
    def from_topology(cls, topology: Topology, name: str, stack: StackSettings) -> "IngestStream":
        if name not in topology.gateways:
            declared = ", ".join(topology.gateways) or "none"
            raise GatewayError(f"topology {topology.app!r} declares no gateway stream {name!r} (declared: {declared}); "
                               "add it under `gateways:`")
        gateway = topology.gateways[name]
        processor = topology.processors[gateway.processor]
        (output,) = processor.outputs
        subject = topology.topics[output].schema_
        settings = IngestSettings.model_validate({**processor.params, **gateway.params})
        output_codec = codec(stack.registry_url, subject, topology.schema(subject))
        return cls(name, Validator(output_codec.schema_json, settings, name), output_codec, output, processor.dlq)

    def accepted(self, record: dict, trace_id: str | None, ingest_ms: int) -> Output:
        """The Avro output of an accepted reading."""
        headers = ingest_headers(record[self.validator.settings.id_field], trace_id or "", ingest_ms)
        return Output(self.output_topic, record[self.validator.settings.entity_field], self.codec.encode(record), headers)

    def rejected(self, exc: Rejected, value: bytes, source: str, *, key: bytes | None = None, client: str | None = None,
                 offset: int = -1) -> Output:
        """The dead letter of a refused reading: its bytes untouched, ``source`` (``http:telemetry``) as source topic."""
        headers = {H_CLIENT_ID: client.encode()} if client else {}
        record = Record(topic=source, partition=-1, offset=offset, key=key, value=value, headers=headers,
                        timestamp_ms=int(time.time() * 1000))
        out = dead_letter(record, self.dlq_topic, f"gateway.{self.name}", exc, exc.reason)
        return Output(out.topic, out.key, out.value, {**out.headers, "dlq.field": exc.field}) if exc.field else out
