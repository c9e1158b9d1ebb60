"""Typed settings of the local stack.

Every field can be overridden from the environment with the ``TANGRAM_`` prefix,
e.g. ``TANGRAM_KAFKA_PORT=19092``. Tests run a second stack beside a developer's
by pointing ``TANGRAM_HOME`` at a temporary folder and shifting the ports.
"""

from __future__ import annotations

import json
import sys
from functools import cached_property
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from streams.security.kafka import KafkaConnection, KafkaSecurity
from streams.security.secrets import SecretStore


#: The operator's principal on a secured local stack: Kafka super user, registry admin, Redis operator.
OPERATOR = "tangram-operator"


def sibling_env(name: str) -> Path:
    """The interpreter of the environment ``name`` beside the running one (``.venv`` → ``.venv-triton``)."""
    return Path(sys.prefix).parent / name / "bin" / "python"


class StackSettings(BaseSettings):
    """Where the local stack keeps its state and which ports it listens on (127.0.0.1)."""

    model_config = SettingsConfigDict(env_prefix="TANGRAM_", frozen=True, extra="forbid", env_nested_delimiter="__")

    home: Path = Field(default_factory=lambda: Path.home() / ".tangram",
                       description="State, logs, pid files and the model repository of the local stack.")
    host: str = Field("127.0.0.1", description="Every component listens on this address only.")
    kafka_host: str | None = Field(None, description="Where clients reach Kafka, if not `host` (e.g. `kafka` in docker-compose).")
    registry_host: str | None = Field(None, description="Where clients reach the schema registry, if not `host`.")
    redis_host: str | None = Field(None, description="Where clients reach Redis, if not `host`.")
    triton_host: str | None = Field(None, description="Where clients reach Triton, if not `host`.")
    kafka_port: int = Field(9092, description="Kafka broker listener.")
    kafka_controller_port: int = Field(9093, description="KRaft controller listener.")
    kafka_brokers: int = Field(
        1, ge=1, le=5, description="Kafka nodes of the local stack (KRaft, each broker and controller): 3 runs a "
                                   "cluster that survives the loss of one node. Node i listens on kafka_port + 2(i-1) "
                                   "and kafka_controller_port + 2(i-1).")
    registry_port: int = Field(8081, description="Schema registry REST API.")
    redis_port: int = Field(6379, description="Redis (online feature store).")
    redis_username: str | None = Field(
        None, description="Redis ACL user (AUTH username); none: `default`, or the operator on a secured local stack.")
    redis_password: SecretStr | None = Field(
        None, description="Redis AUTH password: docker-compose and Kubernetes pass it from a secret; the local "
                          "developer stack's Redis listens on 127.0.0.1 only and has none.")
    secure: bool = Field(
        False, description="The local stack runs secured (docs/security.md): Kafka SASL_SSL with SCRAM-SHA-512 and "
                           "ACLs, the registry with basic auth, Redis with ACL users, Triton's model control behind "
                           "a key. Off by default so the developer flow stays one command.")
    secrets_dir: Path = Field(
        default_factory=lambda fields: fields["home"] / "security",
        description="The secured local stack's CA, certificates and generated passwords (default: <home>/security).")
    kafka_security: KafkaSecurity | None = Field(
        None, description="This process's Kafka security (TANGRAM_KAFKA_SECURITY, JSON, or "
                          "TANGRAM_KAFKA_SECURITY__PASSWORD and the like); none: PLAINTEXT, or the operator's "
                          "principal on a secured local stack.")
    registry_username: str | None = Field(
        None, description="Schema registry basic-auth user; none: no auth, or the operator on a secured local stack.")
    registry_password: SecretStr | None = Field(None, description="Schema registry basic-auth password.")
    triton_control_key: SecretStr | None = Field(
        None, description="The key Triton's model-control API (load, unload, repository index) demands in the "
                          "`tangram-model-control` header; none: unrestricted, or the local secured stack's own.")
    triton_http_port: int = Field(8000, description="Triton HTTP/REST endpoint.")
    triton_grpc_port: int = Field(8001, description="Triton gRPC endpoint.")
    triton_metrics_port: int = Field(8002, description="Triton Prometheus metrics.")
    triton_python: Path = Field(
        default_factory=lambda: sibling_env(".venv-triton"),
        description="Interpreter of the model-server environment (nvidia-pytriton, numpy<2).",
    )
    flink_python: Path = Field(default_factory=lambda: sibling_env(".venv-flink"),
                               description="Interpreter of the Flink job environment (apache-flink).")
    app_python: Path = Field(Path(sys.executable), description="Interpreter of the application environment.")
    model_repository: Path = Field(
        default_factory=lambda fields: fields["home"] / "models",
        description="The stack's Triton model repository, where `tangram apply` installs each app's models "
                    "(default: <home>/models).",
    )
    start_timeout_s: float = Field(90.0, description="How long each component may take to become ready.")

    @field_validator("home", "model_repository", "triton_python", "flink_python", "app_python", "secrets_dir")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        """Paths fixed when the settings are made, so that a process started elsewhere finds the same stack."""
        return path.absolute()

    @model_validator(mode="after")
    def _kafka_ports_distinct(self) -> "StackSettings":
        ports = [port for n in range(1, self.kafka_brokers + 1) for port in self.kafka_node_ports(n)]
        if len(set(ports)) != len(ports):
            raise ValueError(f"kafka_port {self.kafka_port} and kafka_controller_port {self.kafka_controller_port} give "
                             f"{self.kafka_brokers} Kafka nodes overlapping ports {ports}: put the controller port "
                             "one above the broker port")
        return self

    def kafka_node_ports(self, node: int) -> tuple[int, int]:
        """The broker and controller ports of local Kafka node ``node`` (1-based)."""
        return self.kafka_port + 2 * (node - 1), self.kafka_controller_port + 2 * (node - 1)

    @property
    def bootstrap_servers(self) -> str:
        """Every broker of the local stack (or the one ``kafka_host`` names): a client starts from any that answers."""
        if self.kafka_host:
            return f"{self.kafka_host}:{self.kafka_port}"
        return ",".join(f"{self.host}:{self.kafka_node_ports(n)[0]}" for n in range(1, self.kafka_brokers + 1))

    @property
    def secrets(self) -> SecretStore:
        """The secured local stack's generated secrets (made on first use)."""
        return SecretStore(self.secrets_dir / "secrets")

    @property
    def ca_file(self) -> Path:
        """The secured local stack's CA certificate (PEM), which every client trusts."""
        return self.secrets_dir / "ca.pem"

    @cached_property
    def kafka(self) -> KafkaConnection:
        """Where and how this process's Kafka clients connect: ``Consumer(stack.kafka.config({...}))``."""
        security = self.kafka_security
        if security is None and self.secure:
            security = KafkaSecurity(protocol="SASL_SSL", username=OPERATOR, password=self.secrets.get("kafka", OPERATOR),
                                     ca_file=self.ca_file)
        return KafkaConnection(self.bootstrap_servers, security or KafkaSecurity())

    @cached_property
    def registry_auth(self) -> tuple[str, SecretStr] | None:
        """This process's registry user and password (basic auth), if the registry wants one."""
        if self.registry_username:
            return self.registry_username, self.registry_password or SecretStr("")
        if self.secure:
            return OPERATOR, self.secrets.get("registry", OPERATOR)
        return None

    @property
    def registry_address(self) -> str:
        """The registry's URL without credentials: for messages and logs."""
        return f"http://{self.registry_host or self.host}:{self.registry_port}"

    @property
    def registry_url(self) -> str:
        """The registry's URL with this process's basic-auth user in it, as Confluent's clients read it."""
        if self.registry_auth is None:
            return self.registry_address
        user, password = self.registry_auth
        return with_userinfo(self.registry_address, user, password.get_secret_value())

    @property
    def redis_url(self) -> str:
        user, password = self.redis_username, self.redis_password
        if user is None and password is None and self.secure:
            user, password = OPERATOR, self.secrets.get("redis", OPERATOR)
        return with_userinfo(f"redis://{self.redis_host or self.host}:{self.redis_port}/0", user,
                             password.get_secret_value() if password else None)

    @property
    def triton_key(self) -> str | None:
        """The model-control key this process sends to Triton, if Triton demands one."""
        if self.triton_control_key is not None:
            return self.triton_control_key.get_secret_value()
        return self.secrets.get("triton", "model-control").get_secret_value() if self.secure else None

    @property
    def triton_grpc_url(self) -> str:
        return f"{self.triton_host or self.host}:{self.triton_grpc_port}"

    @property
    def triton_http_url(self) -> str:
        return f"{self.triton_host or self.host}:{self.triton_http_port}"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    def environ(self) -> dict[str, str]:
        """The ``TANGRAM_*`` variables that give a child process these settings, secrets included.

        A child that must act as another principal (a processor launched on a secured stack) gets
        its own identity on top (:func:`streams.security.local.identity_env`).
        """
        env = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, dict):
                value = json.dumps(revealed(getattr(self, name)), default=str)
            env[f"TANGRAM_{name.upper()}"] = str(value)
        return env


def revealed(model: KafkaSecurity) -> dict:
    """A settings sub-model as JSON-able data with its secrets in clear (for a child's environment only)."""
    data = model.model_dump(mode="json")
    for name, value in model:
        if isinstance(value, SecretStr):
            data[name] = value.get_secret_value()
    return data


def with_userinfo(url: str, user: str | None, password: str | None) -> str:
    """``url`` with ``user:password@`` in it (percent-encoded), as Redis's and the registry's clients read it."""
    if user is None and password is None:
        return url
    parts = urlsplit(url)
    auth = quote(user or "", safe="") + (f":{quote(password, safe='')}" if password is not None else "")
    return urlunsplit(parts._replace(netloc=f"{auth}@{parts.hostname}:{parts.port}"))


def redact(url: str) -> str:
    """``url`` without its userinfo: what a message or a log line may show."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))

