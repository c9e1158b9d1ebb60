"""Which model versions an inference worker routes to, and Triton serving them (explicit model control).

The worker's rows go to the versions of its routing (:mod:`inference_workers.routing`). The routing
changes without a restart, from the ``routing_file`` or the model registry, by "load the new, switch,
unload the old": Triton loads the versions the new routing needs beside the ones it serves, each passes the
contract check, the worker's calls in flight drain, the routing switches between two batches, then Triton
unloads the versions no longer routed. The registry's previous Production stays loaded (standby), so a
rollback is a switch, not a load; ``models_per_server`` bounds how many versions are loaded at once. A
change Triton refuses is logged and the routing stays; one it cannot take now (down, past a deadline) is
retried at the next refresh.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from inference_workers.routing import ModelTarget, RoutingFile, RoutingPlan, RoutingSettings, VersionRouting
from inference_workers.triton_client import ModelRepository, TritonModel
from streams.errors import ArtifactIntegrityError, InferenceError, InferenceUnavailableError, TopologyError
from streams.lifecycle import ModelRegistryWatcher
from streams.lifecycle.state import Routing
from streams.security.kafka import KafkaConnection
from streams.statelog import StateTopic

log = logging.getLogger("tangram.inference")


class ModelServing:
    """The worker's routing, the Triton clients of its routed versions, and the switches between routings.

    Coroutines run on the worker's event loop through ``run`` (its Triton calls share the clients)."""

    def __init__(self, name: str, model: str, routing: VersionRouting, repository: ModelRepository,
                 client: Callable[[ModelTarget], TritonModel], run: Callable[[Coroutine[Any, Any, Any]], Any], *,
                 routing_file: RoutingFile | None = None, registry_topic: str | None = None,
                 kafka: KafkaConnection | None = None, model_repository: Path | None = None,
                 models_per_server: int | None = None, shadow_topic: str | None = None):
        self.name, self.model = name, model
        self.routing = routing
        self.repository = repository  # Triton's explicit model control
        self.client = client
        self.run = run
        self.routing_file = routing_file
        self.registry_topic = registry_topic  # None: the registry is not followed
        self.kafka = kafka
        self.model_repository = model_repository
        #: the topology's state.models_per_server: the most versions the routing has Triton keep loaded
        self.models_per_server = models_per_server
        self.shadow_topic = shadow_topic
        self.watcher: ModelRegistryWatcher | None = None
        self.models: dict[ModelTarget, TritonModel] = {}
        self._registry_routing: Routing | None = None  # set by the watcher's thread, applied between batches
        self._pending: RoutingSettings | None = None  # a routing change Triton could not take yet: retried
        self._standby: set[ModelTarget] = set()  # the registry's previous Production, kept loaded for rollbacks
        self._stale_standby: set[ModelTarget] = set()  # standby versions replaced since the last switch: unloaded

    @property
    def plan(self) -> RoutingPlan:
        return self.routing.plan

    def start(self) -> None:
        """Take the routing file's or the registry's routing, have Triton serve every routed version and check
        each against the contract; raises on a mismatch or a version Triton cannot load."""
        if self.routing_file and (settings := self.routing_file.poll()):
            self.routing.switch(self.routing.candidate(settings))
        if self.registry_topic is not None:
            StateTopic(self.kafka, self.registry_topic).ensure()  # a fresh stack has none yet
            self.watcher = ModelRegistryWatcher(self.kafka, self.registry_topic, name=self.name).start()
            self.watcher.on_change(self.on_registry_change)
            if (settings := self._registry_settings(self.watcher.current(self.model))) is not None:
                self.routing.switch(self.routing.candidate(settings))
        plan = self.routing.plan
        if plan.shadow and not self.shadow_topic:
            raise TopologyError(f"processor {self.name!r}: shadow routing needs `shadow_topic` in its params")
        self.run(self._serve(plan.targets))
        for target in plan.targets:
            self.run(self.client_of(target))
        log.info("%s routing: %s", self.name, plan.describe())

    async def client_of(self, target: ModelTarget) -> TritonModel:
        """The Triton client of ``target``, made and checked against the contract the first time."""
        model = self.models.get(target)
        if model is None:
            model = self.client(target)
            try:
                await model.setup()  # InferenceError naming the field that differs
            except BaseException:
                await model.close()
                raise
            self.models[target] = model
        return model

    async def ready(self) -> bool:
        """Whether every routed version is served and ready; a routed version Triton does not serve (another
        replica unloaded it after its own switch, Triton restarted with its repository's version policy) is
        loaded again."""
        plan = self.routing.plan
        try:
            await self._serve(plan.targets)
            models = [await self.client_of(t) for t in plan.targets]
        except InferenceError as exc:
            log.info("%s: not ready: %s", self.name, exc)
            return False
        return all(await asyncio.gather(*(m.is_ready() for m in models)))

    async def _serve(self, targets: Sequence[ModelTarget]) -> None:
        """Explicit model control, "load the new": Triton loads each version of ``targets`` it does not serve yet,
        beside the versions it serves (InferenceError when it refuses, Unavailable when it does not answer)."""
        for model in sorted({t.model for t in targets}):
            if loaded := await self.repository.serve(model, {t.version for t in targets if t.model == model}):
                log.info("%s: Triton loaded %s versions %s for the routing", self.name, model, sorted(loaded))

    async def _retire(self, targets: Sequence[ModelTarget]) -> None:
        """Explicit model control, "unload the old": Triton stops serving ``targets``, which no batch of this
        worker uses any more; versions the routing uses stay. A failure is only logged (the version stays loaded)."""
        routed = self.routing.plan.targets
        try:
            for model in sorted({t.model for t in targets}):
                old = {t.version for t in targets if t.model == model} - {t.version for t in routed if t.model == model}
                if retired := await self.repository.retire(model, old):
                    log.info("%s: Triton unloaded %s versions %s, no longer routed", self.name, model, sorted(retired))
        except InferenceError as exc:
            log.warning("%s: unloading %s failed, it stays loaded: %s", self.name, ", ".join(map(str, targets)), exc)

    def on_registry_change(self, before: Routing | None, after: Routing) -> None:
        """The registry watcher's callback (its thread): the new routing is applied by :meth:`refresh`."""
        if after.model == self.model:
            self._registry_routing = after

    def _registry_settings(self, routing: Routing) -> RoutingSettings | None:
        """The registry's routing as worker settings, once every routed artifact matches its digest.

        None while the model has no Production version (the topology's routing stays). Raises
        ArtifactIntegrityError for a tampered or missing artifact: that version is never served.
        """
        if routing.production is None:
            return None
        for ref in (routing.production, routing.challenger):
            if ref is not None:
                self.watcher.verified_path(routing.model, ref, self.model_repository)
        return RoutingSettings(
            production=f"{routing.model}:{routing.production.version}",
            challenger=f"{routing.model}:{routing.challenger.version}" if routing.challenger else None,
            mode="shadow" if routing.shadow else "canary",
            canary_share=0.0 if routing.shadow else routing.canary_share,
        )

    def refresh(self, drain: Callable[[], None]) -> None:
        """Switch to a new routing (the registry's or the routing file's), if any, between two batches; ``drain``
        waits for the worker's calls in flight before anything switches or unloads."""
        settings = None
        if self._registry_routing is not None:
            routing, self._registry_routing = self._registry_routing, None
            # the previous Production stays loaded in Triton: a rollback is then a routing switch, not a load
            standby = {ModelTarget(routing.model, routing.standby.version)} if routing.standby else set()
            self._stale_standby |= self._standby - standby
            self._standby = standby
            try:
                settings = self._registry_settings(routing)
            except ArtifactIntegrityError as exc:
                log.error("%s: registry routing refused, keeping %s: %s", self.name, self.routing.plan.describe(), exc)
                return
        elif self.routing_file is not None:
            settings = self.routing_file.poll()
        if settings is None:
            settings, self._pending = self._pending, None
        if settings is None:
            return
        drain()
        try:
            plan = self.routing.candidate(settings)
            if plan.shadow and not self.shadow_topic:
                raise TopologyError("shadow routing needs `shadow_topic` in the processor's params")
            if self.models_per_server is not None and len(plan.targets) > self.models_per_server:
                raise TopologyError(f"the routing {plan.describe()} needs {len(plan.targets)} versions loaded, "
                                    f"models_per_server is {self.models_per_server}")
            self.run(self._serve(plan.targets))
            for target in plan.targets:
                self.run(self.client_of(target))
        except InferenceUnavailableError as exc:
            self._pending = settings
            log.warning("%s: routing change waits for Triton, keeping %s: %s", self.name, self.routing.plan.describe(),
                        exc)
            return
        except (InferenceError, TopologyError) as exc:
            log.error("%s: routing change refused, keeping %s: %s", self.name, self.routing.plan.describe(), exc)
            return
        self._switch(plan)

    def _switch(self, plan: RoutingPlan) -> None:
        """Route to ``plan`` (its versions served and checked), close the clients and unload the versions no longer
        routed, and keep the standby loaded while ``models_per_server`` allows."""
        previous = self.routing.switch(plan)
        for target in [t for t in self.models if t not in plan.targets]:
            self.run(self.models.pop(target).close())
        stale, self._stale_standby = self._stale_standby, set()
        if dropped := [t for t in {*previous.targets, *stale} if t not in plan.targets and t not in self._standby]:
            self.run(self._retire(dropped))
        standby = [t for t in self._standby if t not in plan.targets]
        if standby and self.models_per_server is not None and len(plan.targets) + len(standby) > self.models_per_server:
            log.info("%s: standby %s not kept loaded: models_per_server %d (a rollback loads it first)", self.name,
                     ", ".join(map(str, standby)), self.models_per_server)
            standby = []
        if standby:
            try:
                self.run(self._serve(standby))
            except InferenceError as exc:  # only a faster rollback is at stake
                log.warning("%s: standby %s not loaded: %s", self.name, ", ".join(map(str, standby)), exc)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        for model in self.models.values():
            self.run(model.close())
        self.models.clear()
        self.run(self.repository.close())


__all__ = ["ModelServing"]
