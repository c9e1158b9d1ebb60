"""What a processor gets to build itself from a topology: its spec, settings, codecs, service addresses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from streams.avro import AvroCodec, topic_codec
from streams.errors import TopologyError
from streams.settings import StackSettings
from streams.topology import ProcessorSpec, Topology

S = TypeVar("S", bound=BaseModel)


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

    def settings(self, model: type[S]) -> S:
        """The processor's ``params`` validated by its settings model; errors name the processor and the field."""
        try:
            return model.model_validate(self.spec.params)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<params>'}: {e['msg']}" for e in exc.errors())
            raise TopologyError(f"processor {self.name!r} of app {self.topology.app!r}: params: {problems}") from exc

    def path(self, relative: str | Path) -> Path:
        """A path the processor's params name, resolved against the app folder."""
        return self.topology.path(relative)

    def codec(self, topic: str) -> AvroCodec:
        """The codec of an Avro topic, bound to the id `tangram apply` registered."""
        return topic_codec(self.topology, self.stack.registry_url, topic)
