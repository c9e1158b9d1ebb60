"""Run one processor of an app: ``tangram run topologies/my_app NAME``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from prometheus_client import start_http_server
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_delay, wait_random_exponential

from streams.context import BuildContext
from streams.delivery import Processor, Runner, RunnerConfig
from streams.errors import ServiceUnavailableError, TopologyError
from streams.settings import StackSettings
from streams.topology import Topology, load_topology

log = logging.getLogger("tangram.run")


#: How long a starting processor waits for a service its build needs (the schema registry) before it gives up.
STARTUP_WAIT_S = float(os.environ.get("TANGRAM_STARTUP_WAIT_S", "300"))


def build_processor(topology: Topology, name: str, stack: StackSettings, *,
                    startup_wait_s: float = STARTUP_WAIT_S) -> Processor:
    """The processor ``name`` of ``topology``, built from its declaration.

    A service its build calls being down (the schema registry, for its codecs) is waited for, with
    jittered backoff, up to ``startup_wait_s``: a processor started before the registry (a restart of
    the whole stack, a registry outage) starts when the registry answers, not never.
    """
    if name not in topology.processors:
        raise TopologyError(f"topology {topology.app!r} has no processor {name!r}; it has {', '.join(topology.processors)}")
    cls = topology.load_object(topology.processors[name].kind)
    if not (isinstance(cls, type) and issubclass(cls, Processor)):
        raise TopologyError(f"processor {name!r}: {cls!r} is not a streams.delivery.Processor (or streams.stage.Stage)")

    def waiting(state: RetryCallState) -> None:
        log.warning("%s: waiting for %s to start (%.0fs so far): %s", name,
                    getattr(state.outcome.exception(), "service", "a service"), state.seconds_since_start,
                    state.outcome.exception())

    for attempt in Retrying(stop=stop_after_delay(startup_wait_s), wait=wait_random_exponential(multiplier=0.5, max=5),
                            retry=retry_if_exception_type(ServiceUnavailableError), before_sleep=waiting,
                            reraise=True):
        with attempt:
            processor = cls.build(BuildContext(topology, name, stack))
    processor.name = name
    return processor


def make_runner(topology: Topology, name: str, stack: StackSettings) -> Runner:
    spec = topology.processors.get(name)
    processor = build_processor(topology, name, stack)
    return Runner(
        processor,
        RunnerConfig(
            kafka=stack.kafka,
            group_id=topology.group(name),
            inputs=tuple(spec.inputs),
            batch_size=spec.batch_size,
            max_wait_ms=spec.max_wait_ms,
            linger_ms=spec.linger_ms,
            commit_interval_ms=spec.commit_interval_ms,
            exactly_once=spec.exactly_once,
        ),
    )


def run(topology_path: str | Path, name: str, stack: StackSettings, metrics_port: int | None = None) -> None:
    topology = load_topology(topology_path)
    runner = make_runner(topology, name, stack)
    runner.install_signal_handlers()
    runner.end_when_stuck()
    runner.freeze_heap = True
    if metrics_port:
        start_http_server(metrics_port, addr=stack.host)
        log.info("%s: metrics on http://%s:%d/metrics", name, stack.host, metrics_port)
    runner.run()
