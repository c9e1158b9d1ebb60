"""Who may do what, generated from the topology: Kafka ACLs and Redis ACL users per principal.

Every processor runs as its own principal, ``<app>.<processor>`` (the gateways of an app as
``<app>.gateway``), and :func:`topology_grants` gives it exactly what its declaration needs:

* read its inputs, as its consumer group;
* write its outputs and its DLQ (and, for an exactly-once processor, use transactional ids
  under its group's prefix);
* read ``_tangram.*`` (the config center and the model registry it follows), never write it.

One declared exception: a canary job (``streams.lifecycle.canary_job:CanaryJob``) writes the
model registry topic its params name; promoting or rolling back a challenger is its whole job,
the operator's decision made by the policy the operator registered.

Nobody else writes ``_tangram.*`` or ``_schemas``: the operator principal (a super user of the
broker) does, and the registry's own principal writes ``_schemas`` only (:func:`registry_grants`).
Processors that call Redis get a Redis user confined to their app's keys: the feature engine
may write them, every other processor only read them.

The same grants are applied to a running broker (:func:`apply_grants`, by ``tangram apply``) and
rendered as Strimzi ``KafkaUser`` ACLs for Kubernetes (:func:`strimzi_acls`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from streams.errors import TopologyError

if TYPE_CHECKING:
    from confluent_kafka.admin import AclBinding

    from streams.topology import Topology

Resource = Literal["topic", "group", "transactional_id"]
Operation = Literal["READ", "WRITE", "DESCRIBE", "CREATE"]

#: The prefix of Tangram's internal compacted topics (config center, model registry).
INTERNAL_PREFIX = "_tangram."
SCHEMAS_TOPIC = "_schemas"
CANARY_KIND = "streams.lifecycle.canary_job:CanaryJob"
FEATURES_KIND = "streams.features:WindowFeatures"
#: The consumer groups of the state-topic followers (config subscriber, model registry watcher):
#: they only assign partitions and never commit, but librdkafka still looks their coordinator up.
STATELOG_GROUPS = "tangram-statelog-"
#: A principal name is also a SCRAM user, a Redis ACL user and a file name: keep it plain.
_PRINCIPAL = re.compile(r"[a-z0-9]([a-z0-9.-]{0,198}[a-z0-9])?")


@dataclass(frozen=True)
class Grant:
    """``principal`` may do ``operations`` on the ``resource`` named ``name`` (or every name starting so)."""

    principal: str
    resource: Resource
    name: str
    operations: tuple[Operation, ...]
    prefixed: bool = False

    def describe(self) -> str:
        where = f"{self.name}*" if self.prefixed else self.name
        return f"User:{self.principal} {'+'.join(self.operations)} {self.resource} {where}"


def _checked(principal: str) -> str:
    if not _PRINCIPAL.fullmatch(principal):
        raise TopologyError(f"principal {principal!r}: letters, digits, '.', '_' and '-' only")
    return principal


def _principal(app: str, name: str) -> str:
    """``<app>.<name>``, lower case, ``_`` as ``-``: the same name works as a SCRAM user, a Redis user and a
    Kubernetes resource (Strimzi's ``KafkaUser`` is named after its principal)."""
    return _checked(f"{app}.{name}".lower().replace("_", "-"))


def processor_principal(topology: Topology, name: str) -> str:
    """The principal a processor runs as: ``<app>.<processor>``."""
    return _principal(topology.app, name)


def gateway_principal(topology: Topology) -> str:
    """The principal the app's HTTP, upload and MQTT gateways run as: ``<app>.gateway``."""
    return _principal(topology.app, "gateway")


def processor_grants(topology: Topology, name: str) -> list[Grant]:
    spec = topology.processors[name]
    who = processor_principal(topology, name)
    grants = [Grant(who, "topic", t, ("READ", "DESCRIBE")) for t in dict.fromkeys([*spec.inputs, *spec.tables])]
    grants.append(Grant(who, "group", topology.group(name), ("READ", "DESCRIBE")))
    written = [*spec.outputs, *([spec.dlq] if spec.dlq else [])]
    grants += [Grant(who, "topic", t, ("WRITE", "DESCRIBE")) for t in dict.fromkeys(written)]
    grants += _follows_internal(who)
    if spec.exactly_once:
        grants.append(Grant(who, "transactional_id", f"{topology.group(name)}-", ("WRITE", "DESCRIBE"), prefixed=True))
    if spec.kind == CANARY_KIND:
        registry_topic = spec.params.get("registry_topic", f"{INTERNAL_PREFIX}models")
        grants.append(Grant(who, "topic", registry_topic, ("WRITE", "DESCRIBE")))
    return grants


def gateway_grants(topology: Topology) -> list[Grant]:
    """The gateways write what their ingest processors write (output and DLQ) and the uploads' topics, and
    read the API keys."""
    if not topology.gateways and not topology.uploads:
        return []
    who = gateway_principal(topology)
    topics: dict[str, None] = {}
    for gateway in topology.gateways.values():
        spec = topology.processors[gateway.processor]
        topics.update(dict.fromkeys([*spec.outputs, *([spec.dlq] if spec.dlq else [])]))
    topics.update(dict.fromkeys(upload.topic for upload in topology.uploads.values()))
    return [*(Grant(who, "topic", t, ("WRITE", "DESCRIBE")) for t in topics), *_follows_internal(who)]


def _follows_internal(who: str) -> list[Grant]:
    """Read ``_tangram.*`` (config center, model registry) with a state-log follower's group."""
    return [Grant(who, "topic", INTERNAL_PREFIX, ("READ", "DESCRIBE"), prefixed=True),
            Grant(who, "group", STATELOG_GROUPS, ("READ",), prefixed=True)]


def topology_grants(topology: Topology) -> list[Grant]:
    """Every grant of the app's processors and gateways."""
    return [g for name in topology.processors for g in processor_grants(topology, name)] + gateway_grants(topology)


def principals(topology: Topology) -> list[str]:
    """The principals of the app: one per processor, one for its gateways if it declares any (or uploads)."""
    return [processor_principal(topology, n) for n in topology.processors] + (
        [gateway_principal(topology)] if topology.gateways or topology.uploads else [])


def principal_grants(topology: Topology) -> dict[str, list[Grant]]:
    """Each principal of the app with its grants (a Strimzi ``KafkaUser`` each)."""
    out: dict[str, list[Grant]] = {p: [] for p in principals(topology)}
    for grant in topology_grants(topology):
        out[grant.principal].append(grant)
    return out


def registry_grants(principal: str, topic: str = SCHEMAS_TOPIC) -> list[Grant]:
    """The schema registry's own principal: its topic, nothing else."""
    return [Grant(_checked(principal), "topic", topic, ("READ", "WRITE", "DESCRIBE", "CREATE"))]


def acl_bindings(grants: Iterable[Grant]) -> list[AclBinding]:
    """confluent-kafka ``AclBinding``s, one per operation (ALLOW, any host)."""
    from confluent_kafka.admin import AclBinding, AclOperation, AclPermissionType, ResourcePatternType, ResourceType

    kinds = {"topic": ResourceType.TOPIC, "group": ResourceType.GROUP, "transactional_id": ResourceType.TRANSACTIONAL_ID}
    return [AclBinding(kinds[g.resource], g.name, ResourcePatternType.PREFIXED if g.prefixed else ResourcePatternType.LITERAL,
                       f"User:{g.principal}", "*", getattr(AclOperation, op), AclPermissionType.ALLOW)
            for g in grants for op in g.operations]


def strimzi_acls(grants: Iterable[Grant]) -> list[dict]:
    """The ``spec.authorization.acls`` of a Strimzi ``KafkaUser`` for these grants."""
    kinds = {"topic": "topic", "group": "group", "transactional_id": "transactionalId"}
    return [{"resource": {"type": kinds[g.resource], "name": g.name, "patternType": "prefix" if g.prefixed else "literal"},
             "operations": [op.capitalize() for op in g.operations]} for g in grants]


# -- Redis ----------------------------------------------------------------------------------------

def redis_role(topology: Topology, name: str) -> Literal["writer", "reader"] | None:
    """What a processor does to the online store: the feature engine writes, any other caller reads; None: no calls."""
    spec = topology.processors[name]
    if not any(call.service == "redis" for call in spec.calls):
        return None
    return "writer" if spec.kind == FEATURES_KIND else "reader"


def redis_rules(project: str, role: Literal["writer", "reader"]) -> list[str]:
    """``ACL SETUSER`` rules (after ``on`` and the password) for a processor of ``project``.

    Keys: Feast's layout ends every key with the project, so ``~*<project>`` confines the user to
    its app's entities. Commands: the hash reads (and the lookup script) for a reader; those plus
    ``HSET``/``EXPIRE`` for the writer. Nothing else: no ``KEYS``, ``FLUSHALL``, ``CONFIG``, ``ACL``.
    """
    reads = ["+@connection", "+hget", "+hmget", "+hgetall", "+exists", "+ttl", "+evalsha", "+eval", "+script|load"]
    writes = ["+hset", "+expire"] if role == "writer" else []
    return ["resetkeys", f"~*{project}", "resetchannels", "-@all", *reads, *writes]
