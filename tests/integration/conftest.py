"""The real local stack for integration tests, beside a developer's.

The session fixture ``stack`` starts Kafka, the schema registry, Redis and Triton (serving the
reference app's models, installed as ``tangram apply`` installs them) from a
temporary ``TANGRAM_HOME`` on shifted ports (kafka 19092, controller 19093, registry 18081,
redis 16379, triton 18000/18001/18002), exports them as ``TANGRAM_*`` variables so that
subprocesses started by tests find the same stack, yields the :class:`StackSettings` and
stops everything at the end. If the stack cannot start the tests fail; they never skip.

``TANGRAM_TEST_COMPONENTS=kafka,redis`` starts only those components (for working on the
stack itself); the default is the whole stack.

The session fixture ``three_node_stack`` starts a stack whose Kafka is three nodes (ports shifted by
``THREE_NODES_SHIFT``), for the loss of one broker of three.

The session fixture ``secured_stack`` starts a second, secured stack (``secure``: Kafka SASL_SSL with
SCRAM-SHA-512 and ACLs, the registry with basic auth, Redis with ACL users, Triton's model control
behind a key) on the test ports shifted by ``SECURED_SHIFT``, with the reference app's models; it
yields the operator's settings. Only the tests that ask for it start it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from reference import pm_topology
from streams.errors import StackError
from streams.lifecycle.repository import install_models, model_dirs
from streams.settings import StackSettings
from streams.stack import NAMES, down, up
from streams.stack.kafka import data_dir

#: TANGRAM_TEST_PORT_OFFSET shifts every test port, so that two test sessions (two checkouts,
#: two developers on one machine) can run at once.
_OFFSET = int(os.environ.get("TANGRAM_TEST_PORT_OFFSET", "0"))
TEST_PORTS: dict[str, int] = {
    name: port + _OFFSET
    for name, port in {
        "kafka_port": 19092,
        "kafka_controller_port": 19093,
        "registry_port": 18081,
        "redis_port": 16379,
        "triton_http_port": 18000,
        "triton_grpc_port": 18001,
        "triton_metrics_port": 18002,
    }.items()
}


#: The processors a test session launches look for metrics ports from here (streams.launcher), so that two
#: sessions' processors don't race for the same free port between the check and the bind.
os.environ.setdefault("TANGRAM_METRICS_BASE_PORT", str(9100 + _OFFSET))

#: The secured test stack listens on the test ports plus this.
SECURED_SHIFT = 100
#: The three-node test stack (three Kafka nodes, the registry, Redis, Triton) listens on the test ports plus this.
THREE_NODES_SHIFT = 200


def stack_env(settings: StackSettings) -> dict[str, str]:
    """The ``TANGRAM_*`` variables that point a subprocess at ``settings``'s stack (as its operator when secured)."""
    return settings.environ()


def stack_components() -> list[str]:
    """The components the test stack runs: all, unless TANGRAM_TEST_COMPONENTS names some."""
    wanted = os.environ.get("TANGRAM_TEST_COMPONENTS", "").strip()
    return [n.strip() for n in wanted.split(",") if n.strip()] if wanted else list(NAMES)


@pytest.fixture(scope="session")
def components() -> list[str]:
    """The names of the components that the test stacks run (see ``stack_components``)."""
    return stack_components()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackSettings]:
    """The running test stack (session-scoped); stopped when the session ends."""
    settings = StackSettings(home=tmp_path_factory.mktemp("tangram-home"), **TEST_PORTS)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in stack_env(settings).items():
            mp.setenv(key, value)
        yield from _running(settings, stack_components())


@pytest.fixture(scope="session")
def secured_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackSettings]:
    """The running secured test stack (session-scoped), as its operator; stopped when the session ends.

    Its settings are not exported to the environment (the plain stack's are): a subprocess meant
    for it gets ``stack_env(secured_stack)``.
    """
    ports = {name: port + SECURED_SHIFT for name, port in TEST_PORTS.items()}
    settings = StackSettings(home=tmp_path_factory.mktemp("tangram-secured"), secure=True, **ports)
    yield from _running(settings, list(NAMES))


@pytest.fixture(scope="session")
def three_node_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackSettings]:
    """A running stack whose Kafka is three KRaft nodes (session-scoped; only the tests that ask start it).

    Like the secured stack, its settings are not exported to the environment: a subprocess meant for it
    gets ``stack_env(three_node_stack)``. Node 1's log directory is a 256 MiB tmpfs of its own (mounted when
    the tests run as root, as CI does) for the disk-full fault; elsewhere that test fails saying how to
    give it one.
    """
    ports = {name: port + THREE_NODES_SHIFT for name, port in TEST_PORTS.items()}
    settings = StackSettings(home=tmp_path_factory.mktemp("tangram-3-nodes"), kafka_brokers=3, **ports)
    with _small_disk(data_dir(settings), "256m"):
        yield from _running(settings, list(NAMES))


@contextlib.contextmanager
def _small_disk(path: Path, size: str) -> Iterator[None]:
    """``path`` on a tmpfs of ``size`` for the block's duration, when this process may mount one (root)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], capture_output=True).returncode == 0
    try:
        yield
    finally:
        if mounted:
            subprocess.run(["umount", "--lazy", str(path)], check=False)


def _running(settings: StackSettings, components: list[str]) -> Iterator[StackSettings]:
    try:
        up(settings, only=components)
        if "triton" in components:  # the reference app's models, as `tangram apply` installs them
            app = pm_topology()
            install_models(app, settings, [m.name for m in model_dirs(app.model_repository)])
    except StackError as exc:
        down(settings, only=components)
        pytest.fail(f"the local test stack could not start: {exc}", pytrace=False)
    try:
        yield settings
    finally:
        # clients left in reference cycles by the tests are freed while their broker still answers; after
        # `down` they would go on reconnecting to it ("Connection refused") until the interpreter exits
        gc.collect()
        down(settings, only=components)
