"""What a processor gets to build itself from a topology: its spec, codecs, service addresses."""

from __future__ import annotations

from dataclasses import dataclass

from streams.avro import AvroCodec, codec
from streams.errors import TopologyError
from streams.settings import StackSettings
from streams.topology import ProcessorSpec, Topology, load_schema


@dataclass(frozen=True)
class BuildContext:
    topology: Topology
    name: str
    stack: StackSettings

    @property
    def spec(self) -> ProcessorSpec:
        return self.topology.processors[self.name]

    @property
    def dlq(self) -> str:
        if not self.spec.dlq:
            raise TopologyError(f"processor {self.name!r} needs a `dlq:` topic: bad records must go somewhere")
        return self.spec.dlq

    def codec(self, topic: str) -> AvroCodec:
        """The codec of an Avro topic, bound to the id `tangram apply` registered."""
        subject = self.topology.topics[topic].schema_
        if not subject:
            raise TopologyError(f"topic {topic!r} is not an Avro topic")
        return codec(self.stack.registry_url, subject, load_schema(subject))
