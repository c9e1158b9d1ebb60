"""Typed settings of the local stack.

Every field can be overridden from the environment with the ``TANGRAM_`` prefix,
e.g. ``TANGRAM_KAFKA_PORT=19092``. Tests run a second stack beside a developer's
by pointing ``TANGRAM_HOME`` at a temporary folder and shifting the ports.
"""

from __future__ import annotations

import sys
from pathlib import Path

from urllib.parse import quote

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def sibling_env(name: str) -> Path:
    """The interpreter of the environment ``name`` beside the running one (``.venv`` → ``.venv-triton``)."""
    return Path(sys.prefix).parent / name / "bin" / "python"


class StackSettings(BaseSettings):
    """Where the local stack keeps its state and which ports it listens on (127.0.0.1)."""

    model_config = SettingsConfigDict(env_prefix="TANGRAM_", frozen=True, extra="forbid")

    home: Path = Field(default_factory=lambda: Path.home() / ".tangram",
                       description="State, logs, pid files and the model repository of the local stack.")
    host: str = Field("127.0.0.1", description="Every component listens on this address only.")
    kafka_host: str | None = Field(None, description="Where clients reach Kafka, if not `host` (e.g. `kafka` in docker-compose).")
    registry_host: str | None = Field(None, description="Where clients reach the schema registry, if not `host`.")
    redis_host: str | None = Field(None, description="Where clients reach Redis, if not `host`.")
    triton_host: str | None = Field(None, description="Where clients reach Triton, if not `host`.")
    kafka_port: int = Field(9092, description="Kafka broker listener.")
    kafka_controller_port: int = Field(9093, description="KRaft controller listener.")
    registry_port: int = Field(8081, description="Schema registry REST API.")
    redis_port: int = Field(6379, description="Redis (online feature store).")
    redis_password: SecretStr | None = Field(
        None, description="Redis AUTH password: docker-compose and Kubernetes pass it from a secret; the local "
                          "stack's Redis listens on 127.0.0.1 only and has none.")
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

    @field_validator("home", "model_repository", "triton_python", "flink_python", "app_python")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        """Paths fixed when the settings are made, so that a process started elsewhere finds the same stack."""
        return path.absolute()

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.kafka_host or self.host}:{self.kafka_port}"

    @property
    def registry_url(self) -> str:
        return f"http://{self.registry_host or self.host}:{self.registry_port}"

    @property
    def redis_url(self) -> str:
        auth = f":{quote(self.redis_password.get_secret_value(), safe='')}@" if self.redis_password else ""
        return f"redis://{auth}{self.redis_host or self.host}:{self.redis_port}/0"

    @property
    def triton_grpc_url(self) -> str:
        return f"{self.triton_host or self.host}:{self.triton_grpc_port}"

    @property
    def triton_http_url(self) -> str:
        return f"{self.triton_host or self.host}:{self.triton_http_port}"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"
