"""What a processor gets to build itself from a topology: its spec, settings, codecs, service addresses."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from streams.avro import AvroCodec, RegistryFailure, registry_client, topic_codec
from streams.errors import TopologyError
from streams.resilience import Calls
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

    @cached_property
    def calls(self) -> Calls:
        """The processor's external calls as its ``calls:`` declare them (:mod:`streams.resilience`):
        ``ctx.calls.guard("redis", failures)`` is the one guard of its Redis calls."""
        return Calls(self.name, self.spec.calls)

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
        """The codec of an Avro topic, bound to the id `tangram apply` registered.

        Its registry calls go through the processor's registry guard (its ``calls:`` declaration)."""
        registry_client(self.stack.registry_url).guard = self.calls.guard("registry", (RegistryFailure,))
        return topic_codec(self.topology, self.stack.registry_url, topic)
