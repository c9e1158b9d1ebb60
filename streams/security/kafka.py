"""How every Kafka client of Tangram connects: one typed config, rendered for each client library.

:class:`KafkaSecurity` is the one place a client's security settings live: the protocol (PLAINTEXT,
the local developer stack's default, or SASL_SSL), the SASL mechanism (SCRAM), the principal's
username and password, and the CA that signed the brokers' certificates. It is a field of
:class:`streams.settings.StackSettings` (``TANGRAM_KAFKA_SECURITY``, JSON), so a processor, the
CLI, the registry and the gateways read it the way they read every other setting, and each of
them gets only its own principal's password (docker-compose and Kubernetes pass it from a secret).

It is rendered, here and nowhere else, for the three client libraries Tangram runs:

* librdkafka (confluent-kafka: processors, CLI, registry, gateways): :meth:`KafkaSecurity.librdkafka`;
* aiokafka (Faust, the embedded feature engine): :meth:`KafkaSecurity.aiokafka`;
* the Java client (Flink's Kafka connector, Strimzi, ``kafka-*.sh``): :meth:`KafkaSecurity.java`.

:class:`KafkaConnection` (bootstrap servers plus security) is what a class that opens clients is
given, and ``connection.config({...})`` is the one way a client configuration is built.

This module needs only pydantic and the standard library: the Flink and Feast environments import it.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

Protocol = Literal["PLAINTEXT", "SASL_SSL"]
Mechanism = Literal["SCRAM-SHA-512", "SCRAM-SHA-256"]

#: Flink's SQL Kafka connector jar relocates the Kafka client under this package, so a JAAS login
#: module must be named with it there (``KafkaSecurity.java(shaded=True)``).
FLINK_SHADED_PREFIX = "org.apache.flink.kafka.shaded."
_SCRAM_MODULE = "org.apache.kafka.common.security.scram.ScramLoginModule"
#: The environment variable that carries a process's Kafka security (JSON), as StackSettings names it.
ENV = "TANGRAM_KAFKA_SECURITY"


class KafkaSecurity(BaseModel):
    """A Kafka client's security: protocol, SASL principal and the CA it trusts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    protocol: Protocol = Field("PLAINTEXT", description="PLAINTEXT (the local developer stack) or SASL_SSL.")
    mechanism: Mechanism = Field("SCRAM-SHA-512", description="SASL mechanism of SASL_SSL.")
    username: str | None = Field(None, description="The SASL principal (User:<username> in ACLs).")
    password: SecretStr | None = Field(None, description="The principal's password (from a secret).")
    ca_file: Path | None = Field(None, description="PEM file of the CA that signed the brokers' certificates; "
                                                   "none: the system's trust store.")
    verify_hostname: bool = Field(True, description="Check that a broker's certificate names the host dialled.")

    @model_validator(mode="after")
    def _complete(self) -> KafkaSecurity:
        if self.protocol == "SASL_SSL" and (not self.username or self.password is None):
            raise ValueError("SASL_SSL needs a username and a password (TANGRAM_KAFKA_SECURITY)")
        return self

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> KafkaSecurity:
        """The security the ``TANGRAM_KAFKA_SECURITY`` variables give, read as ``StackSettings`` reads them.

        For the jobs that run in the Flink and Feast environments, which have pydantic but not
        pydantic-settings: ``TANGRAM_KAFKA_SECURITY`` (JSON), then ``TANGRAM_KAFKA_SECURITY__<FIELD>``.
        """
        data = json.loads(environ.get(ENV, "{}") or "{}")
        prefix = f"{ENV}__"
        data.update({k[len(prefix):].lower(): v for k, v in environ.items() if k.startswith(prefix)})
        return cls.model_validate(data)

    @property
    def secured(self) -> bool:
        return self.protocol != "PLAINTEXT"

    @property
    def principal(self) -> str:
        """The ACL principal the broker sees: ``User:<username>``, or ``User:ANONYMOUS`` on PLAINTEXT."""
        return f"User:{self.username}" if self.secured else "User:ANONYMOUS"

    def as_user(self, username: str, password: SecretStr | str) -> KafkaSecurity:
        """The same connection as another principal (a processor launched by the operator's stack)."""
        secret = password if isinstance(password, SecretStr) else SecretStr(password)
        return self.model_copy(update={"username": username, "password": secret})

    def _secret(self) -> str:
        return self.password.get_secret_value() if self.password is not None else ""

    # -- renderings ------------------------------------------------------------------------------

    def librdkafka(self) -> dict[str, Any]:
        """librdkafka properties (confluent-kafka's Consumer, Producer and AdminClient)."""
        if not self.secured:
            return {"security.protocol": "plaintext"}
        conf: dict[str, Any] = {
            "security.protocol": "sasl_ssl",
            "sasl.mechanism": self.mechanism,
            "sasl.username": self.username,
            "sasl.password": self._secret(),
            "ssl.endpoint.identification.algorithm": "https" if self.verify_hostname else "none",
        }
        if self.ca_file is not None:
            conf["ssl.ca.location"] = str(self.ca_file)
        return conf

    def ssl_context(self) -> ssl.SSLContext:
        """A TLS context trusting ``ca_file`` (or the system's CAs), for asyncio clients."""
        context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        context.check_hostname = self.verify_hostname
        return context

    def aiokafka(self) -> dict[str, Any]:
        """aiokafka keyword arguments (Faust passes them on from its ``broker_credentials``)."""
        if not self.secured:
            return {"security_protocol": "PLAINTEXT"}
        return {"security_protocol": "SASL_SSL", "sasl_mechanism": self.mechanism,
                "sasl_plain_username": self.username, "sasl_plain_password": self._secret(),
                "ssl_context": self.ssl_context()}

    def java(self, *, shaded: bool = False) -> dict[str, str]:
        """Java client properties (Flink's connector takes them with a ``properties.`` prefix).

        ``shaded``: name the login module as Flink's SQL connector jar relocates it.
        """
        if not self.secured:
            return {"security.protocol": "PLAINTEXT"}
        module = (FLINK_SHADED_PREFIX if shaded else "") + _SCRAM_MODULE
        jaas = f'{module} required username="{_jaas_quote(self.username or "")}" password="{_jaas_quote(self._secret())}";'
        props = {"security.protocol": "SASL_SSL", "sasl.mechanism": self.mechanism, "sasl.jaas.config": jaas,
                 "ssl.endpoint.identification.algorithm": "https" if self.verify_hostname else ""}
        if self.ca_file is not None:
            props.update({"ssl.truststore.type": "PEM", "ssl.truststore.location": str(self.ca_file)})
        return props


def _jaas_quote(text: str) -> str:
    """A value inside a JAAS ``key="value"`` pair."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


@dataclass(frozen=True)
class KafkaConnection:
    """Where a client connects and how: what every class that opens Kafka clients is given.

    ``str()`` is the bootstrap address and protocol (for messages); the password never shows.
    """

    bootstrap_servers: str
    security: KafkaSecurity = field(default_factory=KafkaSecurity)

    def config(self, conf: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A librdkafka configuration: the connection and its security, then ``conf`` (a client's own settings)."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.security.librdkafka(), **(conf or {})}

    def __str__(self) -> str:
        return f"{self.bootstrap_servers} ({self.security.protocol})"


__all__ = ["FLINK_SHADED_PREFIX", "KafkaConnection", "KafkaSecurity"]
