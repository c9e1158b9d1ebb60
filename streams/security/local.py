"""The secured local stack's principals: provisioned by the operator, worn by the processes it launches.

On a stack with ``secure`` on, ``tangram apply`` runs as the operator and, for every principal of
the app (:func:`streams.security.acls.principals`), upserts its SCRAM-SHA-512 credential, creates
the ACLs the topology grants it, and gives each processor that calls Redis a Redis ACL user
confined to the app's keys; it creates the ``_tangram.*`` topics the processors follow, which
they may read but not create. Passwords come from the stack's :class:`SecretStore`.

The launcher then starts each processor with :func:`identity_env`: its own Kafka principal, the
registry's read-only user, its Redis user (if it has one) and Triton's model-control key (the
inference worker only), and ``TANGRAM_SECURE=false`` so it never falls back to the operator's
credentials. In docker-compose and Kubernetes the same identities come from secrets.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from streams.errors import StackError
from streams.security.acls import (
    Grant, acl_bindings, principals, processor_principal, redis_role, redis_rules, registry_grants, topology_grants,
)
from streams.security.kafka import KafkaSecurity
from streams.settings import OPERATOR, StackSettings
from streams.topology import Kind, Topology

log = logging.getLogger("tangram.security")

#: The registry's read-only user on a secured local stack (processors, gateways, jobs).
REGISTRY_READER = "tangram-reader"
#: The schema registry service's own Kafka principal: reads and writes ``_schemas``, nothing else.
REGISTRY_PRINCIPAL = "tangram-registry"
TIMEOUT_S = 30.0


def principal_security(stack: StackSettings, principal: str) -> KafkaSecurity:
    """``principal``'s Kafka security on the secured local stack (its password from the secret store)."""
    return KafkaSecurity(protocol="SASL_SSL", username=principal, password=stack.secrets.get("kafka", principal),
                         ca_file=stack.ca_file)


def _identity(stack: StackSettings, principal: str, redis: bool, model_control: bool) -> dict[str, Any]:
    """The settings that make a process ``principal``: never the operator's (``secure`` off), only what it needs."""
    identity: dict[str, Any] = {
        "secure": False, "kafka_security": principal_security(stack, principal),
        "registry_username": REGISTRY_READER, "registry_password": stack.secrets.get("registry", REGISTRY_READER)}
    if redis:
        identity.update(redis_username=principal, redis_password=stack.secrets.get("redis", principal))
    if model_control:
        identity["triton_control_key"] = SecretStr(stack.triton_key or "")
    return identity


def settings_as(stack: StackSettings, principal: str, *, redis: bool = False, model_control: bool = False) -> StackSettings:
    """The settings a process of ``principal`` has on the secured local stack (in-process: a test, a gateway)."""
    return StackSettings(**{**stack.model_dump(), **_identity(stack, principal, redis, model_control)})


def identity_env(stack: StackSettings, principal: str, *, redis: bool = False, model_control: bool = False) -> dict[str, str]:
    """The ``TANGRAM_*`` variables that make a child process ``principal`` on a secured local stack ({} if not secured)."""
    if not stack.secure:
        return {}
    names = {f"TANGRAM_{name.upper()}" for name in _identity(stack, principal, redis, model_control)}
    return {k: v for k, v in settings_as(stack, principal, redis=redis, model_control=model_control).environ().items()
            if k in names}


def processor_env(stack: StackSettings, topology: Topology, name: str) -> dict[str, str]:
    """A processor's identity: its principal, its Redis user if it calls Redis, model control if it serves models."""
    return identity_env(stack, processor_principal(topology, name), redis=redis_role(topology, name) is not None,
                        model_control=topology.processors[name].kind == Kind.INFERENCE)


def registry_users_file(stack: StackSettings) -> Path:
    """Write the registry's users file: the operator as admin, the reader as read-only; returns its path."""
    from streams.registry.auth import RegistryUsers

    users = (RegistryUsers()
             .with_user(OPERATOR, "admin", stack.secrets.get("registry", OPERATOR).get_secret_value())
             .with_user(REGISTRY_READER, "read-only", stack.secrets.get("registry", REGISTRY_READER).get_secret_value()))
    path = stack.secrets_dir / "registry-users.json"
    users.save(path)
    return path


def redis_acl_file(stack: StackSettings) -> Path:
    """Redis's ACL file as the stack starts it: ``default`` off, the operator allowed everything.

    Processors' users are added by ``tangram apply`` (``ACL SETUSER``, then ``ACL SAVE`` into this file).
    """
    path = stack.secrets_dir / "redis-users.acl"
    if not path.exists():
        password = stack.secrets.get("redis", OPERATOR).get_secret_value()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(f"user default off\nuser {OPERATOR} on >{password} ~* &* +@all\n")
    return path


def upsert_kafka_principals(stack: StackSettings, grants: list[Grant], users: list[str]) -> int:
    """Give ``users`` their SCRAM credentials and create ``grants`` on the broker (both idempotent); returns ACLs made."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

    admin = AdminClient(stack.kafka.config())
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192)
    upserts = [UserScramCredentialUpsertion(u, info, stack.secrets.get("kafka", u).get_secret_value().encode())
               for u in users]
    bindings = acl_bindings(grants)
    try:
        for user, future in admin.alter_user_scram_credentials(upserts).items():
            future.result(timeout=TIMEOUT_S)
        for binding, future in admin.create_acls(bindings, request_timeout=TIMEOUT_S).items():
            future.result(timeout=TIMEOUT_S)
    except KafkaException as exc:
        raise StackError(f"the operator could not provision principals {', '.join(users)} on {stack.kafka}: {exc}") from exc
    log.info("provisioned %d principal(s) and %d ACL(s) on %s", len(users), len(bindings), stack.kafka)
    return len(bindings)


def provision_registry_principal(stack: StackSettings) -> None:
    """The schema registry service's principal and its ACLs (before the registry starts)."""
    upsert_kafka_principals(stack, registry_grants(REGISTRY_PRINCIPAL), [REGISTRY_PRINCIPAL])


def provision_app(topology: Topology, stack: StackSettings) -> list[str]:
    """Every principal of the app on the secured local stack: SCRAM, ACLs, Redis users; what was done, as lines."""
    from streams.statelog import StateTopic

    grants = topology_grants(topology)
    users = principals(topology)
    upsert_kafka_principals(stack, grants, users)
    for topic in ("_tangram.config", "_tangram.models"):  # processors follow them and may not create them
        StateTopic(stack.kafka, topic).ensure()
    redis_users = _provision_redis(topology, stack)
    return [*(f"kafka principal User:{u}" for u in users), *(g.describe() for g in grants),
            *(f"redis user {u}" for u in redis_users)]


def _provision_redis(topology: Topology, stack: StackSettings) -> list[str]:
    import redis

    wanted = {processor_principal(topology, n): role for n in topology.processors
              if (role := redis_role(topology, n)) is not None}
    if not wanted:
        return []
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        for user, role in wanted.items():
            password = stack.secrets.get("redis", user).get_secret_value()
            client.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}",
                                   *redis_rules(topology.app, role))
        client.execute_command("ACL", "SAVE")
    except redis.RedisError as exc:
        raise StackError(f"the operator could not create Redis users {', '.join(wanted)}: {exc}") from exc
    finally:
        client.close()
    return list(wanted)
