"""The one CLI: `tangram init | up | down | status | plan | apply | run | demo | verify | models | config | ...`.

Every command that works on an application takes the app's folder (or its topology file).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from streams.config_center.cli import config_app
from streams.lifecycle.cli import models_app
from streams.settings import StackSettings

app = typer.Typer(help="Tangram: Kafka-native streaming dataflow for production AI.", no_args_is_help=True)
stack_app = typer.Typer(help="Local stack chores.", no_args_is_help=True)
app.add_typer(stack_app, name="stack")
app.add_typer(models_app, name="models")

#: The argument every app command takes.
AppArg = typer.Argument(..., help="The app: its folder (holding topology.yaml) or its topology file.")
app.add_typer(config_app, name="config")
from streams.gateway.cli import dlq_app, gateway_app, schemas_app  # noqa: E402  (data contracts, gateways, DLQ)
app.add_typer(schemas_app, name="schemas")
app.add_typer(gateway_app, name="gateway")
app.add_typer(dlq_app, name="dlq")
from streams.security.cli import keys_app, mqtt_auth  # noqa: E402  (security chores)
app.add_typer(keys_app, name="keys")
gateway_app.command("mqtt-auth")(mqtt_auth)


def _settings() -> StackSettings:
    return StackSettings()


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    for noisy in ("httpx", "httpx2", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@app.command()
def up() -> None:
    """Start Kafka (KRaft), the schema registry, Redis and Triton on 127.0.0.1."""
    from streams.stack import up as stack_up

    stack_up(_settings())


@app.command()
def down() -> None:
    """Stop every component of the local stack (its data stays under TANGRAM_HOME)."""
    from streams.stack import down as stack_down

    stack_down(_settings())


@app.command()
def status(
    topology: Optional[Path] = typer.Option(None, "--topology", "-t", help="Show this running topology instead: rates, "
                                            "lag, p99, DLQ, config, models, drift (live until Ctrl-C)."),
    once: bool = typer.Option(False, "--once", help="With --topology: one snapshot, then exit."),
    as_json: bool = typer.Option(False, "--json", help="With --topology --once: print the snapshot as JSON."),
    interval: float = typer.Option(2.0, help="With --topology: seconds between snapshots (rates are over it)."),
) -> None:
    """Show each component of the stack (pid, address, ready), or with --topology the running topology."""
    if topology is not None:
        from streams.monitor.status import show
        from streams.topology import load_topology

        show(load_topology(topology), _settings(), once=once, as_json=as_json, interval_s=interval)
        return
    from streams.stack import status as stack_status

    raise typer.Exit(0 if stack_status(_settings()) else 1)


@stack_app.command("jars")
def stack_jars() -> None:
    """Resolve the Kafka jars with Maven (cached in ~/.m2) into TANGRAM_HOME."""
    from streams.stack import fetch_jars

    fetch_jars(_settings())


def _show_changes(changes, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not changes:
        console.print(f"{title}: nothing to change")
        return
    table = Table(title=title)
    for col in ("change", "target", "detail"):
        table.add_column(col)
    for c in changes:
        table.add_row(c.kind, c.target, c.detail)
    console.print(table)


@app.command()
def init(
    name: str = typer.Argument(..., help="The new app's name: lowercase letters, digits, _ (its topics' prefix)."),
    directory: Optional[Path] = typer.Option(None, "--dir", help="Where to create the app folder (default: ./NAME)."),
) -> None:
    """Scaffold a new app: topology, schemas, a feature set, a tiny model, one rule; it runs as it is."""
    from rich.console import Console

    from streams.scaffold import scaffold

    folder = scaffold(name, directory or Path(name))
    Console().print(f"created app [bold]{name}[/] in {folder}; next: `tangram models build {folder}`, "
                    f"`tangram apply {folder}`, `tangram run {folder} <processor>` (see {folder / 'README.md'})")


@app.command()
def plan(
    topology: Path = AppArg,
    models: bool = typer.Option(True, "--models/--no-models", help="Include the app's models (see `apply`)."),
    capacity: bool = typer.Option(False, "--capacity", help="Instead: the partitions, replicas, Flink parallelism "
                                  "and Triton servers the declared peak rates need, from the last `make bench` "
                                  "figures (no stack needed); exits 1 when a topic's partitions cannot carry its peak."),
    bench: Optional[Path] = typer.Option(None, "--bench", help="With --capacity: the results file of `make bench` "
                                         "(default: <TANGRAM_HOME>/bench/results.json)."),
) -> None:
    """Show what `apply` would change on the broker, the schema registry and the model server."""
    from streams.topology import load_topology

    if capacity:
        _plan_capacity(load_topology(topology), bench or _settings().home / "bench" / "results.json")
        return
    from streams.plan import plan as make_plan

    _show_changes(make_plan(load_topology(topology), _settings(), models=models), f"plan for {topology}")


def _plan_capacity(topology, bench_file: Path) -> None:
    """``plan --capacity``: two tables (topic rates, stage sizing), each number's source, exit 1 on a refusal."""
    from rich.console import Console
    from rich.table import Table

    from streams.capacity import load_bench, plan_capacity
    from streams.topology import Kind

    def num(value) -> str:
        return "?" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:,.3g}"

    cited: list = []  # bench figures, numbered in the order the table cites them

    def cite(figure) -> str:
        if figure not in cited:
            cited.append(figure)
        return f"bench {figure.commit} [{cited.index(figure) + 1}]"

    result = plan_capacity(topology, load_bench(bench_file))
    console = Console()
    topics = Table(title=f"{topology.app}: topic rates (records/s)")
    for col in ("topic", "baseline", "peak", "from", "partitions"):
        topics.add_column(col)
    read = {t for spec in topology.processors.values() for t in spec.inputs}
    for name, rate in result.topics.items():
        if name in read or topology.topics[name].data:
            topics.add_row(name, num(rate.baseline), num(rate.peak), rate.source, str(topology.partitions(name)))
    console.print(topics)
    stages = Table(title=f"{topology.app}: capacity at the declared peak")
    for col in ("stage", "peak in/s", "a replica/s", "from", "util", "replicas (declared)", "partitions (have)",
                "Flink slots", "Triton servers"):
        stages.add_column(col)
    for s in result.stages:
        source = cite(s.capacity.figure) if s.capacity.figure else (
            "declared" if s.capacity.per_replica else "unknown")
        flink = triton = ""
        if s.kind == Kind.FEATURES:
            flink = num(s.flink_parallelism) + (f" at {num(s.flink_figure.rate)}/slot, {cite(s.flink_figure)}"
                                                if s.flink_figure else " (no Flink figure)")
        if s.kind == Kind.INFERENCE:
            triton = num(s.triton_servers) + (f" at {num(s.triton_per_server)}/server, {cite(s.triton_figure)}"
                                              if s.triton_figure else " (no Triton figure)")
        partitions = f"{num(s.partitions_needed)} ({s.partitions})"
        stages.add_row(s.name, num(s.rate.sizing), num(s.capacity.per_replica), source, f"{s.target_utilization:g}",
                       f"{num(s.replicas_needed)} ({s.replicas_declared})",
                       partitions if s.fits else f"[red]{partitions}[/red]", flink, triton)
    console.print(stages)
    console.print(f"bench figures: {result.bench.source}" + (f" ({result.bench.machine})" if result.bench.machine else ""))
    for i, figure in enumerate(cited, 1):
        console.print(f"  [{i}] {figure.path}: {figure.rate:,.0f} {figure.unit}/s, N={figure.n:,}, batch "
                      f"{figure.batch or '-'}, commit {figure.commit}" + (f" ({figure.benchmark})" if figure.benchmark else ""),
                      highlight=False)
    console.print("declared: compute.max_rate_per_replica; unknown: neither a figure of the stage's kind nor a "
                  "declaration; replicas = ceil(peak / (a replica/s × util)); partitions ≥ replicas")
    for note in result.notes:
        console.print(f"note: {note}")
    if refusals := result.refusals():
        console.print("[red]refused:[/red] the declared peak does not fit the partitions:\n  - " + "\n  - ".join(refusals))
        raise typer.Exit(1)
    console.print("every stage's peak fits its inputs' partitions")


@app.command()
def apply(
    topology: Path = AppArg,
    models: bool = typer.Option(True, "--models/--no-models",
                                help="Install the app's models into the stack's Triton repository (the local stack); "
                                     "--no-models where a deploy step fills the model server's repository."),
) -> None:
    """Create topics, register schemas and install the app's models so the stack matches it (idempotent)."""
    from streams.plan import apply as do_apply
    from streams.topology import load_topology

    _show_changes(do_apply(load_topology(topology), _settings(), models=models), f"applied {topology}")


@app.command()
def run(
    topology: Path = AppArg,
    processor: str = typer.Argument(..., help="Processor name in the topology."),
    metrics_port: Optional[int] = typer.Option(None, help="Serve Prometheus metrics on this port."),
) -> None:
    """Run one processor of a topology until SIGTERM (at-least-once unless the topology asks exactly-once)."""
    from streams.run import run as run_processor

    run_processor(topology, processor, _settings(), metrics_port)


@app.command()
def demo(
    topology: Path = AppArg,
    duration: float = typer.Option(60.0, help="Seconds of simulated events."),
    entities: int = typer.Option(20, help="Simulated entities (devices, documents, ...), as the app's simulator has them."),
    seed: int = typer.Option(7, help="Simulator seed."),
    drill: bool = typer.Option(True, "--drill/--no-drill", help="The lifecycle drill: a model version promoted "
                               "(the canary job starts its canary) and rolled back live, each change timed."),
) -> None:
    """Run an app on the local stack with its simulator and score it against the simulator's ground truth."""
    from streams.demo import run_demo

    run_demo(_settings(), topology, duration, entities, seed, drill=drill)


def entry() -> None:
    """Console entry point: operator errors print as one clear line, not a traceback."""
    from rich.console import Console

    from streams.errors import TangramError

    try:
        app()
    except TangramError as exc:
        Console(stderr=True).print(f"[red]error:[/red] {exc}")
        raise SystemExit(2) from None


@app.command()
def diagram(
    topology: Path = AppArg,
    out: Optional[Path] = typer.Option(None, help="Output path without suffix; default <app folder>/diagram."),
    formats: str = typer.Option("svg,png,mmd", help="Comma-separated: svg, png, mmd (Mermaid), dot."),
    capacity: bool = typer.Option(False, "--capacity", help="Draw each stage's sizing at the declared peak: the "
                                                             "figures `tangram plan --capacity` prints."),
    bench: Optional[Path] = typer.Option(None, "--bench", help="With --capacity: the results file of `make bench` "
                                                                "(default <TANGRAM_HOME>/bench/results.json)."),
) -> None:
    """Draw the topology with its constraints (SVG/PNG via Graphviz, Mermaid text)."""
    from rich.console import Console

    from streams.capacity import load_bench, plan_capacity
    from streams.diagram import render
    from streams.topology import load_topology

    loaded = load_topology(topology)
    base = out or loaded.folder / "diagram"
    sizing = (plan_capacity(loaded, load_bench(bench or _settings().home / "bench" / "results.json"))
              if capacity else None)
    for path in render(loaded, base, tuple(f.strip() for f in formats.split(",") if f.strip()), sizing):
        Console().print(f"wrote {path}")


compose_app = typer.Typer(help="Files docker-compose provisions, generated from the topology.", no_args_is_help=True)
app.add_typer(compose_app, name="compose")


@compose_app.command("prometheus")
def compose_prometheus(
    topology: Path = AppArg,
    out: Path = typer.Option(Path("deploy"), help="Folder of prometheus/ and grafana/ (docker compose mounts it)."),
) -> None:
    """Write <out>/prometheus/prometheus.yml (a scrape job per processor) and the Grafana dashboards."""
    from rich.console import Console

    from streams.monitor.dashboards import write_all
    from streams.topology import load_topology

    for path in write_all(load_topology(topology), out):
        Console().print(f"wrote {path}")


@app.command()
def verify(
    topology: Path = AppArg,
    load_seconds: float = typer.Option(20.0, help="Duration of step 4's load at the declared baseline rate."),
    kill: str = typer.Option("inference", help="The processor step 4 kills with SIGKILL and restarts."),
    steps: str = typer.Option("1,2,3,4", help="The steps to run, e.g. `1,2,3` (no load and chaos)."),
) -> None:
    """Run the four-step verification (protocol, connectivity, chain, load+chaos); non-zero exit on a violation."""
    from streams.verify import verify as run_verify

    chosen = tuple(int(s) for s in steps.split(",") if s.strip())
    if not chosen or not set(chosen) <= {1, 2, 3, 4}:
        raise typer.BadParameter(f"steps {steps!r}: a comma-separated subset of 1,2,3,4", param_hint="--steps")
    checks = run_verify(topology, _settings(), load_seconds, kill, steps=chosen)
    raise typer.Exit(0 if all(c.ok for c in checks) else 1)


@app.command()
def chaos(
    topology: Path = AppArg,
    faults: str = typer.Option("short", help="`short` (each of ingest, features, inference, rules killed; Redis and "
                                             "Triton frozen; the broker killed; the registry down at the rules' "
                                             "start; oversize), `long` (also drift and canary killed, Redis and "
                                             "Triton stopped, the registry down at inference's start; of those "
                                             "processors, the ones the app has), or a "
                                             "comma-separated list of kill:<processor>, kill:broker, freeze:redis, "
                                             "freeze:triton, stop:redis, stop:triton, registry-at-start:<processor>, "
                                             "disk-full:broker (needs Kafka's log directory on a small "
                                             "filesystem of its own), oversize."),
    rate: float = typer.Option(200.0, help="Events/s of the load (the app simulator's, every event valid)."),
    fault_s: float = typer.Option(8.0, help="Seconds a freeze, a stop, the broker's or the registry's outage lasts."),
    exactly_once: bool = typer.Option(False, "--exactly-once", help="Every processor with Kafka transactions."),
    report: Optional[Path] = typer.Option(None, "--report", help="Write the report as JSON here."),
) -> None:
    """A fault campaign against the running local stack under load; every event accounted for, recovery per fault.

    It runs the app's processors under a fresh namespace (its own topics and consumer groups: the live app
    is not touched) on the stack of `tangram up`, drives them with the app's simulator (every event valid),
    and injects the faults one after the other: kill:<processor> (kill -9, restarted at once), freeze:redis
    and freeze:triton (SIGSTOP of the serving processes for --fault-s), stop:redis and stop:triton (stopped
    and started again), kill:broker (kill -9 of the Kafka broker, restarted after --fault-s),
    registry-at-start:<processor> (the schema registry down while the processor restarts), disk-full:broker
    (the filesystem under Kafka's log directory filled for --fault-s, then emptied; the node started again if
    it stopped: the log directory must be on a small filesystem of its own), oversize (a
    record just under the producer's size limit and one over it). Recovery: from a fault's end until every
    group committed past what its inputs held then.

    At the end it reads every topic back and counts, by event id: sent (acknowledged), accepted, dead-lettered
    (by stage and reason), duplicated, lost; the windows the accepted readings make and their predictions.
    Exit status 0 only when something was sent, nothing was lost, no valid event was dead-lettered (no
    duplicate either with --exactly-once) and every fault recovered within the timeout. The faults kill and
    freeze processes of the local stack: never run it against a stack others use."""
    from rich.console import Console

    from streams.chaos import LONG, SHORT, Campaign, print_report

    chosen = SHORT if faults == "short" else LONG if faults == "long" else tuple(
        f.strip() for f in faults.split(",") if f.strip())
    console = Console()
    campaign = Campaign(topology, _settings(), faults=chosen, rate=rate, fault_s=fault_s,
                        exactly_once=exactly_once, console=console)
    try:
        result = campaign.run()
    finally:
        campaign.close()
    print_report(result, console)
    if report is not None:
        report.write_text(result.to_json())
    recovered = all(f.recovery_s is not None for f in result.faults)
    raise typer.Exit(0 if result.accounting.clean(exactly_once) and recovered else 1)


replay_app = typer.Typer(help="Copy topic ranges into isolated namespaces for backtests.", no_args_is_help=True)
app.add_typer(replay_app, name="replay")


def _epoch_ms(text: Optional[str]) -> Optional[int]:
    """Epoch milliseconds from `1764480000000` or an ISO 8601 time (`2026-11-30T08:00:00Z`)."""
    if text is None:
        return None
    if text.isdigit():
        return int(text)
    from datetime import datetime, timezone

    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return int((moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp() * 1000)


@replay_app.command("copy")
def replay_copy(
    topology: Path = AppArg,
    topic: Optional[str] = typer.Option(None, help="Live topic to copy; default the simulator's source topic."),
    from_offset: Optional[int] = typer.Option(None, help="First offset (every partition)."),
    to_offset: Optional[int] = typer.Option(None, help="End offset, exclusive (every partition)."),
    since: Optional[str] = typer.Option(None, help="First record time: epoch ms or ISO 8601."),
    until: Optional[str] = typer.Option(None, help="End time, exclusive: epoch ms or ISO 8601."),
    partition: Optional[list[int]] = typer.Option(None, help="Only these partitions (repeat the option)."),
    run_id: Optional[str] = typer.Option(None, help="Name of the run; default a random id."),
) -> None:
    """Copy a range of a live topic into a namespace of its own (keys, headers, timestamps, partitions kept)."""
    from rich.console import Console

    from streams.replay import replay

    run = replay(_settings(), topology, topic, run_id=run_id, start_offset=from_offset, end_offset=to_offset,
                 start_ms=_epoch_ms(since), end_ms=_epoch_ms(until), partitions=partition)
    ranges = ", ".join(f"[{p}] {lo}-{hi}" for p, (lo, hi) in sorted(run.ranges.items()))
    Console().print(f"run [bold]{run.run_id}[/]: copied {run.records:,} records of {run.topic} ({ranges}) into "
                    f"namespace {run.prefix} in {run.seconds:.2f}s ({run.rate:,.0f} records/s); "
                    f"`tangram backtest {run.run_id} --version 1` scores it")


@replay_app.command("list")
def replay_list() -> None:
    """The replay runs with their parameters."""
    from rich.console import Console
    from rich.table import Table

    from streams.replay import list_runs

    table = Table(title="replay runs")
    for col in ("run", "created", "topic", "ranges", "records", "namespace"):
        table.add_column(col)
    for run in list_runs(_settings()):
        ranges = ", ".join(f"[{p}] {lo}-{hi}" for p, (lo, hi) in sorted(run.ranges.items()))
        table.add_row(run.run_id, run.created, run.topic, ranges, f"{run.records:,}", run.prefix)
    Console().print(table)


@replay_app.command("delete")
def replay_delete(run_id: str = typer.Argument(..., help="The run to remove.")) -> None:
    """Delete a run's topics and consumer groups (its backtests' too) and its files."""
    from rich.console import Console

    from streams.replay import delete_run

    topics, groups = delete_run(_settings(), run_id)
    Console().print(f"deleted run {run_id}: {len(topics)} topics, {len(groups)} consumer groups")


@app.command()
def backtest(
    run_id: str = typer.Argument(..., help="A replay run (`tangram replay list`)."),
    version: list[str] = typer.Option(["1"], help="Model version(s) to compare; repeat the option."),
) -> None:
    """Run the topology over a replayed range with the given model version(s) and report against ground truth."""
    from streams.replay import backtest as run_backtest

    run_backtest(_settings(), run_id, version)


@app.command()
def trace(
    topology: Path = AppArg,
    event_id: str = typer.Argument(..., help="The event's event_id."),
    lookback: float = typer.Option(3600.0, help="How far back to look for the reading, in seconds."),
) -> None:
    """Print one reading's path through every stage, with per-stage times and trace ids."""
    from rich.console import Console

    from streams.topology import load_topology
    from streams.trace import print_trace, trace as find

    print_trace(event_id, find(_settings(), load_topology(topology), event_id, lookback), Console())


deploy_app = typer.Typer(help="Deploy targets rendered from the topology (docker-compose is docker-compose.yml).",
                         no_args_is_help=True)
app.add_typer(deploy_app, name="deploy")


@deploy_app.command("k8s")
def deploy_k8s(
    topology: Path = typer.Argument(..., help="The app folder or its topology file."),
    out: Path = typer.Option(..., "--out", help="Folder to write the Helm chart into (replaced if it exists)."),
    image: Optional[str] = typer.Option(None, help="The Tangram image, repository:tag; default tangram:<version>."),
    app_path: Optional[str] = typer.Option(None, help="The app inside the image; default /app/topologies/<name>."),
    kafka_cluster: str = typer.Option("tangram", help="The Strimzi Kafka cluster the topics belong to."),
) -> None:
    """Render a Helm chart: a Deployment per processor and gateway, lag autoscaling, KafkaTopics, Triton, registry, Redis."""
    from rich.console import Console

    from streams.deploy import ChartSettings, render_chart
    from streams.topology import load_topology

    given = {"image": image} if image else {}
    settings = ChartSettings(app_path=app_path or f"/app/topologies/{topology.stem}", kafka_cluster=kafka_cluster,
                             **given)
    written = render_chart(load_topology(topology), str(topology), out, settings)
    Console().print(f"wrote {len(written)} files into {out}; `helm install <release> {out}` deploys it")


from streams.security.cli import erase, erasures, registry_user  # noqa: E402  (erasure; the registry's users)

app.command("erase")(erase)
app.command("erasures")(erasures)
app.command("registry-user")(registry_user)
