"""``tangram plan`` / ``tangram apply``: make the broker, the registry and the model server match an app.

Topics (partitions, configs), schema subjects (with their compatibility level) and the app's
models (installed into the stack's Triton repository and loaded). Idempotent: applying twice
changes nothing the second time. Partitions can only grow (Kafka cannot shrink a topic); asking
for fewer is an error, not a silent note.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewPartitions, NewTopic
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from streams.constraints import violations
from streams.errors import TopologyError
from streams.lifecycle.repository import install_models, pending_installs
from streams.schemas_check import load_levels
from streams.security.local import provision_app
from streams.settings import StackSettings
from streams.topology import Topology

TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Change:
    kind: str  # create-topic | add-partitions | alter-config | set-compatibility | register-schema | install-model | grant
    target: str
    detail: str


def _admin(stack: StackSettings) -> AdminClient:
    return AdminClient(stack.kafka.config())


def plan(topology: Topology, stack: StackSettings, *, models: bool = True) -> list[Change]:
    """What `apply` would change, computed against the running broker and registry (and the stack's model
    repository, unless ``models`` is false: a deploy step of its own fills the model server's repository).

    Refuses first, with every breach listed, a topology whose constraints the runtime cannot honour.
    """
    breaches = violations(topology)
    from streams.rules.check import rule_problems  # every rule of every rule processor compiles

    breaches += rule_problems(topology)
    if breaches:
        raise TopologyError("the topology declares what the runtime cannot honour:\n  - " + "\n  - ".join(breaches))
    admin = _admin(stack)
    try:
        existing = admin.list_topics(timeout=TIMEOUT_S).topics
    except KafkaException as exc:
        raise TopologyError(f"cannot reach Kafka at {stack.kafka}: {exc}; is the stack up (`tangram up`)?") from exc
    changes: list[Change] = []
    to_describe = []
    for name in topology.topics:
        want = topology.partitions(name)
        if name not in existing:
            configs = " ".join(f"{k}={v}" for k, v in topology.topic_configs(name).items())
            changes.append(Change("create-topic", name, f"{want} partitions, rf {topology.replication(name)}, {configs}"))
            continue
        have = len(existing[name].partitions)
        if have > want:
            raise TopologyError(f"topic {name!r} has {have} partitions; the topology asks {want}, and Kafka cannot shrink a topic")
        if have < want:
            changes.append(Change("add-partitions", name, f"{have} → {want}"))
        to_describe.append(name)
    if to_describe:
        futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, n) for n in to_describe])
        for resource, future in futures.items():
            current = future.result(timeout=TIMEOUT_S)
            wanted = topology.topic_configs(resource.name)
            diff = {k: v for k, v in wanted.items() if current[k].value != v}
            if diff:
                changes.append(Change("alter-config", resource.name, ", ".join(f"{k}={current[k].value}→{v}" for k, v in diff.items())))
    registry = SchemaRegistryClient({"url": stack.registry_url, "timeout": TIMEOUT_S})
    levels = load_levels(topology.schema_dir)
    for subject, text in topology.subjects().items():
        try:
            current = registry.get_compatibility(subject)  # the subject's level, else the global one
            if current != levels.level(subject):
                changes.append(Change("set-compatibility", subject, f"{current} → {levels.level(subject)}"))
            registry.lookup_schema(subject, Schema(text, "AVRO"))
        except SchemaRegistryError as exc:
            if exc.http_status_code != 404:
                raise TopologyError(f"registry at {stack.registry_address} failed looking up {subject}: {exc}") from exc
            changes.append(Change("register-schema", subject, str(topology.schema_path(subject))))
        except Exception as exc:  # connection refused and friends
            raise TopologyError(f"cannot reach the schema registry at {stack.registry_address}: {exc}") from exc
    if models:
        changes += [Change("install-model", model, detail) for model, detail in pending_installs(topology, stack).items()]
    return changes


def apply(topology: Topology, stack: StackSettings, *, models: bool = True) -> list[Change]:
    """Make the changes `plan` lists; returns them."""
    changes = plan(topology, stack, models=models)
    admin = _admin(stack)
    creates = [
        NewTopic(c.target, num_partitions=topology.partitions(c.target), replication_factor=topology.replication(c.target),
                 config=topology.topic_configs(c.target))
        for c in changes if c.kind == "create-topic"
    ]
    if creates:
        for name, future in admin.create_topics(creates, operation_timeout=TIMEOUT_S).items():
            _wait(future, f"create topic {name}")
    _wait_for_leaders(admin, [c.target for c in changes if c.kind in ("create-topic", "add-partitions")])
    grows = [NewPartitions(c.target, topology.partitions(c.target)) for c in changes if c.kind == "add-partitions"]
    if grows:
        for name, future in admin.create_partitions(grows).items():
            _wait(future, f"add partitions to {name}")
    for c in changes:
        if c.kind == "alter-config":
            resource = ConfigResource(ConfigResource.Type.TOPIC, c.target, set_config=topology.topic_configs(c.target))
            for _, future in admin.alter_configs([resource]).items():
                _wait(future, f"alter configs of {c.target}")
    registry = SchemaRegistryClient({"url": stack.registry_url, "timeout": TIMEOUT_S})
    levels = load_levels(topology.schema_dir)
    for c in changes:  # levels first: a new version is then checked under the declared rule
        if c.kind == "set-compatibility":
            try:
                registry.set_compatibility(subject_name=c.target, level=levels.level(c.target))
            except SchemaRegistryError as exc:
                raise TopologyError(f"registry refused compatibility {levels.level(c.target)} for {c.target}: {exc}") from exc
    for c in changes:
        if c.kind == "register-schema":
            text = topology.subjects()[c.target]
            json.loads(text)
            try:
                registry.register_schema(c.target, Schema(text, "AVRO"))
            except SchemaRegistryError as exc:
                raise TopologyError(f"registry refused {c.target}: {exc}") from exc
    install_models(topology, stack, [c.target for c in changes if c.kind == "install-model"])
    if stack.secure:  # every principal of the app, its ACLs and Redis users (idempotent, so every apply)
        changes += [Change("grant", line, "from the topology") for line in provision_app(topology, stack)]
    return changes


def _wait_for_leaders(admin: AdminClient, topics: list[str]) -> None:
    """Return once every partition of ``topics`` has a leader, so clients can use them at once."""
    deadline = time.monotonic() + TIMEOUT_S
    pending = set(topics)
    while pending and time.monotonic() < deadline:
        metadata = admin.list_topics(timeout=TIMEOUT_S).topics
        pending = {t for t in pending
                   if t not in metadata or metadata[t].error is not None
                   or any(p.leader < 0 for p in metadata[t].partitions.values())}
        if pending:
            time.sleep(0.1)
    if pending:
        raise TopologyError(f"topics without a leader after {TIMEOUT_S:.0f}s: {', '.join(sorted(pending))}")


def _wait(future, what: str) -> None:
    try:
        future.result(timeout=TIMEOUT_S)
    except KafkaException as exc:
        raise TopologyError(f"{what} failed: {exc}") from exc
