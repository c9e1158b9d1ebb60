"""The four components of the local stack, in dependency order.

Kafka first (the registry stores its schemas in a Kafka topic), then the schema registry,
Redis (the online feature store) and Triton (model serving). Each is a
:class:`~streams.stack.process.ManagedProcess` with its command line, ports, readiness probe,
log file (``<home>/logs/<name>.log``) and pid file (``<home>/run/<name>.pid``).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path

import inference_workers
from streams.errors import StackError
from streams.security import local
from streams.settings import StackSettings, redact, revealed
from streams.stack import kafka
from streams.stack.process import ManagedProcess, port_open

log = logging.getLogger("tangram.stack")

NAMES = ("kafka", "registry", "redis", "triton")


def _http_ok(url: str) -> bool:
    """True when ``url`` answers 200; its userinfo, if any, is sent as basic auth (the secured registry)."""
    parts = urllib.parse.urlsplit(url)
    request = urllib.request.Request(redact(url))
    if parts.username is not None:
        user_info = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        request.add_header("Authorization", "Basic " + base64.b64encode(user_info.encode()).decode())
    with urllib.request.urlopen(request, timeout=2.0) as resp:  # noqa: S310 - local http only
        return resp.status == 200


def _kafka_ready(settings: StackSettings, node: int = 1) -> bool:
    """Node ``node`` answers a metadata request and counts itself among the cluster's brokers."""
    port = settings.kafka_node_ports(node)[0]
    if not port_open(settings.host, port):
        return False  # spare librdkafka's connection-refused noise while the JVM starts
    from confluent_kafka.admin import AdminClient

    address = f"{settings.kafka_host or settings.host}:{port}"
    admin = AdminClient(settings.kafka.config({"bootstrap.servers": address,
                                               "logger": logging.getLogger("tangram.stack.kafka-probe")}))
    return node in admin.list_topics(timeout=3.0).brokers


def _redis_ready(settings: StackSettings) -> bool:
    import redis

    client = redis.Redis.from_url(settings.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        return bool(client.ping())
    finally:
        client.close()


def _need_python(python: Path, what: str) -> None:
    if not python.exists():
        raise StackError(f"the {what} interpreter {python} is missing: run `make setup`")


def _prepare_registry(settings: StackSettings) -> None:
    _need_python(settings.app_python, "application")
    if settings.secure:
        local.registry_users_file(settings)


def _registry_argv(settings: StackSettings) -> list[str]:
    argv = [str(settings.app_python), "-m", "streams.registry", "--host", settings.host,
            "--port", str(settings.registry_port), "--bootstrap", settings.bootstrap_servers]
    return argv + (["--users", str(settings.secrets_dir / "registry-users.json")] if settings.secure else [])


def _registry_env(settings: StackSettings) -> dict[str, str]:
    """On a secured stack the registry connects to Kafka as its own principal (``_schemas`` only)."""
    if not settings.secure:
        return {}
    security = local.principal_security(settings, local.REGISTRY_PRINCIPAL)
    return {"TANGRAM_KAFKA_SECURITY": json.dumps(revealed(security), default=str)}


def _redis_server() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise StackError("redis-server is required: install it (apt-get install redis-server, or `make setup`)")
    return exe


def _prepare_redis(settings: StackSettings) -> None:
    _redis_server()
    (settings.home / "redis").mkdir(parents=True, exist_ok=True)
    if settings.secure:
        local.redis_acl_file(settings)


def _redis_argv(settings: StackSettings) -> list[str]:
    """redis-server on ``host`` only; secured: ACL users from a file (``default`` off), no other way in.

    Its append-only file is its persistence, alone: the default RDB snapshots (every minute under writes) would
    fork and write the whole online store again beside it, a core for seconds at a time on a small machine (7 s
    for 1.6M rows of the reference feature set, measured on 2 cores during a benchmark)."""
    argv = [_redis_server(), "--bind", settings.host, "--port", str(settings.redis_port),
            "--dir", str(settings.home / "redis"), "--appendonly", "yes", "--save", "",
            "--daemonize", "no", "--logfile", "", "--protected-mode", "yes"]
    return argv + (["--aclfile", str(settings.secrets_dir / "redis-users.acl")] if settings.secure else [])


#: The model server, run as a script by the model-server environment's interpreter: that environment
#: (numpy<2) must not see the application's packages, so the script imports nothing of them.
TRITON_SERVER = Path(inference_workers.__file__).with_name("triton_server.py")


def _prepare_triton(settings: StackSettings) -> None:
    _need_python(settings.triton_python, "Triton")
    settings.model_repository.mkdir(parents=True, exist_ok=True)  # apps' models arrive with `tangram apply`


def _triton_env(settings: StackSettings) -> dict[str, str]:
    """LD_LIBRARY_PATH to the Triton interpreter's own libpython.

    PyTriton's Python-backend stub links ``libpython3.11.so``; without this it may load the
    system's and fail.
    """
    env: dict[str, str] = {}
    if settings.triton_key:  # the wrapper restricts Triton's model control to callers that send it
        env["TANGRAM_TRITON_CONTROL_KEY"] = settings.triton_key
    if settings.triton_python.exists():
        libdir = subprocess.run(
            [str(settings.triton_python), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
            capture_output=True, text=True,
        ).stdout.strip()
        if libdir:
            env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH", "")) if p)
    return env


def _kafka_node(settings: StackSettings, node: int, files: Callable[[str], dict[str, Path]]) -> ManagedProcess:
    """Kafka node ``node``: component ``kafka``, named ``kafka`` (node 1) or ``kafka-<node>``."""
    broker, controller = settings.kafka_node_ports(node)
    name = "kafka" if node == 1 else f"kafka-{node}"
    return ManagedProcess(
        name=name,
        component="kafka",
        argv=partial(kafka.argv, settings, node),
        marker=str(kafka.properties_path(settings, node)),
        host=settings.host,
        ports={"broker": broker, "controller": controller},
        address=f"{settings.kafka_host or settings.host}:{broker} (controller :{controller})",
        probe=partial(_kafka_ready, settings, node),
        prepare=partial(kafka.prepare, settings, node),
        after_ready=partial(local.provision_registry_principal, settings) if settings.secure else None,
        stop_timeout_s=30.0,
        **files(name),
    )


def build(settings: StackSettings) -> list[ManagedProcess]:
    """The components of ``settings``'s stack, in start order."""
    h, logs, run = settings.host, settings.logs_dir, settings.home / "run"

    def files(name: str) -> dict[str, Path]:
        return {"log_path": logs / f"{name}.log", "pid_path": run / f"{name}.pid"}

    return [
        *(_kafka_node(settings, node, files) for node in range(1, kafka.node_count(settings) + 1)),
        ManagedProcess(
            name="registry",
            argv=partial(_registry_argv, settings),
            marker="streams.registry",
            host=h,
            ports={"http": settings.registry_port},
            address=settings.registry_address,
            probe=partial(_http_ok, f"{settings.registry_url}/subjects"),
            prepare=partial(_prepare_registry, settings),
            env=partial(_registry_env, settings),
            **files("registry"),
        ),
        ManagedProcess(
            name="redis",
            argv=partial(_redis_argv, settings),
            marker="redis-server",
            host=h,
            ports={"redis": settings.redis_port},
            address=redact(settings.redis_url),
            probe=partial(_redis_ready, settings),
            prepare=partial(_prepare_redis, settings),
            **files("redis"),
        ),
        ManagedProcess(
            name="triton",
            argv=lambda: [str(settings.triton_python), str(TRITON_SERVER),
                          "--model-repository", str(settings.model_repository), "--host", h,
                          "--http-port", str(settings.triton_http_port),
                          "--grpc-port", str(settings.triton_grpc_port),
                          "--metrics-port", str(settings.triton_metrics_port)],
            # the script as any installation names it (a checkout, a wheel): a stack brought up by one is
            # stopped by another, never left running with its pid file gone
            marker=f"{TRITON_SERVER.parent.name}/{TRITON_SERVER.name}",
            host=h,
            ports={"http": settings.triton_http_port, "grpc": settings.triton_grpc_port,
                   "metrics": settings.triton_metrics_port},
            address=f"http://{settings.triton_http_url} (grpc :{settings.triton_grpc_port}, "
                    f"metrics :{settings.triton_metrics_port})",
            probe=partial(_http_ok, f"http://{settings.triton_http_url}/v2/health/ready"),
            prepare=partial(_prepare_triton, settings),
            env=partial(_triton_env, settings),
            stop_timeout_s=20.0,
            **files("triton"),
        ),
    ]
