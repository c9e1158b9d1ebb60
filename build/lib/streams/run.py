"""Run one processor of an app: ``tangram run topologies/my_app NAME``."""

from __future__ import annotations

import logging
from pathlib import Path

from prometheus_client import start_http_server

from streams.context import BuildContext
from streams.delivery import Processor, Runner, RunnerConfig
from streams.errors import TopologyError
from streams.settings import StackSettings
from streams.topology import Topology, load_topology

log = logging.getLogger("tangram.run")


def build_processor(topology: Topology, name: str, stack: StackSettings) -> Processor:
    if name not in topology.processors:
        raise TopologyError(f"topology {topology.app!r} has no processor {name!r}; it has {', '.join(topology.processors)}")
    cls = topology.load_object(topology.processors[name].kind)
    if not (isinstance(cls, type) and issubclass(cls, Processor)):
        raise TopologyError(f"processor {name!r}: {cls!r} is not a streams.delivery.Processor (or streams.stage.Stage)")
    processor = cls.build(BuildContext(topology, name, stack))
    processor.name = name
    return processor


def make_runner(topology: Topology, name: str, stack: StackSettings) -> Runner:
    spec = topology.processors.get(name)
    processor = build_processor(topology, name, stack)
    return Runner(
        processor,
        RunnerConfig(
            bootstrap_servers=stack.bootstrap_servers,
            group_id=topology.group(name),
            inputs=tuple(spec.inputs),
            batch_size=spec.batch_size,
            max_wait_ms=spec.max_wait_ms,
            exactly_once=spec.exactly_once,
        ),
    )


def run(topology_path: str | Path, name: str, stack: StackSettings, metrics_port: int | None = None) -> None:
    topology = load_topology(topology_path)
    runner = make_runner(topology, name, stack)
    runner.install_signal_handlers()
    if metrics_port:
        start_http_server(metrics_port, addr=stack.host)
        log.info("%s: metrics on http://%s:%d/metrics", name, stack.host, metrics_port)
    runner.run()
