"""A standalone Flink cluster from the Flink distribution the PyFlink wheel ships, and job submission to it.

The ``apache-flink`` wheel of the Flink environment (``.venv-flink``) carries a complete Flink
distribution: ``bin/jobmanager.sh``, ``bin/taskmanager.sh``, ``bin/flink``, ``lib/``. ``FlinkCluster``
starts a JobManager and TaskManagers from it as processes of their own (``start-foreground``, no Docker),
with a configuration written under ``<TANGRAM_HOME>/flink/cluster``: REST and RPC ports, task slots,
checkpoints on local disk (``file://<home>/flink/checkpoints``), a restart strategy, and short heartbeats
so that a TaskManager that dies is noticed in seconds. ``submit`` runs ``flink run --python`` against
any JobManager address (this one, or a remote one: ``--jobmanager host:port``), shipping the job's jars
and the runtime's Python code; the job's arguments are those of ``streams.flink.job``.

    python -m streams.flink.cluster up            # JobManager + one TaskManager
    python -m streams.flink.cluster submit -- --bootstrap ... --registry ... --dlq ... --feature-set ...
    python -m streams.flink.cluster down
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from streams.errors import StackError
from streams.flink.launcher import SOURCE_ROOT, fetch_jars, flink_python, job_env
from streams.settings import StackSettings


def flink_home(python: Path | None = None) -> Path:
    """The Flink distribution inside the Flink environment's ``pyflink`` package."""
    python = python or flink_python()
    found = subprocess.run([str(python), "-c", "import pyflink, os; print(os.path.dirname(pyflink.__file__))"],
                           capture_output=True, text=True, check=False)
    if found.returncode != 0:
        raise StackError(f"pyflink is not importable by {python}: run `make setup`\n{found.stderr[-1000:]}")
    return Path(found.stdout.strip())


@dataclass
class FlinkCluster:
    """A JobManager and TaskManagers on this machine (see the module's doc)."""

    settings: StackSettings
    rest_port: int = 8091  # not 8081: the schema registry's
    rpc_port: int = 6123
    slots: int = 2
    taskmanager_memory: str = "1400m"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def root(self) -> Path:
        return self.settings.home / "flink" / "cluster"

    @property
    def tmp(self) -> Path:
        """The cluster's temporary files (``io.tmp.dirs``, the JVMs' ``java.io.tmpdir``, the Python workers'
        ``TMPDIR``) and the start scripts' pid files: a TaskManager's working directory, its extracted RPC jar, the
        Python workers' files. A process killed with -9 cannot remove its own; ``down`` removes them all, so none
        is left in the system's ``/tmp``."""
        return self.root / "tmp"

    @property
    def checkpoints(self) -> Path:
        return self.settings.home / "flink" / "checkpoints"

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.rest_port}"

    def _configure(self) -> Path:
        home = flink_home()
        conf = self.root / "conf"
        conf.mkdir(parents=True, exist_ok=True)
        for name in ("log4j.properties", "log4j-console.properties", "log4j-cli.properties", "logback.xml",
                     "logback-console.xml"):
            if (home / "conf" / name).is_file():
                (conf / name).write_bytes((home / "conf" / name).read_bytes())
        config = {
            "jobmanager.rpc.address": self.settings.host, "jobmanager.rpc.port": self.rpc_port,
            "jobmanager.bind-host": self.settings.host, "taskmanager.bind-host": self.settings.host,
            "taskmanager.host": self.settings.host,
            "rest.address": self.settings.host, "rest.bind-address": self.settings.host, "rest.port": self.rest_port,
            "jobmanager.memory.process.size": "900m", "taskmanager.memory.process.size": self.taskmanager_memory,
            "taskmanager.numberOfTaskSlots": self.slots,
            "execution.checkpointing.dir": self.checkpoints.as_uri(),
            "state.backend.type": "hashmap",
            "restart-strategy.type": "fixed-delay", "restart-strategy.fixed-delay.attempts": 1000,
            "restart-strategy.fixed-delay.delay": "1 s",
            # a TaskManager killed with -9 is noticed in seconds, not the default 50
            "heartbeat.interval": 1000, "heartbeat.timeout": 6000,
            "python.executable": str(flink_python()), "python.client.executable": str(flink_python()),
            "io.tmp.dirs": str(self.tmp),
            "env.java.opts.all": f"{_java_opts(home)} -Djava.io.tmpdir={self.tmp}".strip(),
        }
        (conf / "config.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in config.items()))
        return conf

    def _lib(self) -> Path:
        """The distribution's ``lib/`` plus ``opt/flink-python``, as Flink's docs have a cluster that runs Python
        jobs set up (links, the wheel's own files left as they are)."""
        home, lib = flink_home(), self.root / "lib"
        lib.mkdir(parents=True, exist_ok=True)
        for jar in [*(home / "lib").glob("*.jar"), *(home / "opt").glob("flink-python-*.jar")]:
            link = lib / jar.name
            if not link.exists():
                link.symlink_to(jar)
        return lib

    def _env(self, conf: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"FLINK_CONF_DIR": str(conf), "FLINK_LOG_DIR": str(self.root / "log"), "FLINK_LIB_DIR": str(self._lib()),
                    "TMPDIR": str(self.tmp), "FLINK_PID_DIR": str(self.tmp),
                    "PYTHONPATH": os.pathsep.join(p for p in (str(SOURCE_ROOT), env.get("PYTHONPATH", "")) if p)})
        (self.root / "log").mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        return env

    def _start(self, name: str, script: str) -> subprocess.Popen:
        env = self._env(self._configure())
        out = (self.root / "log" / f"{name}.out").open("ab")
        proc = subprocess.Popen(["bash", str(flink_home() / "bin" / script), "start-foreground"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def up(self, taskmanagers: int = 1, timeout_s: float = 120.0) -> None:
        """Start the JobManager and ``taskmanagers`` TaskManagers; wait until their slots are registered."""
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)  # what a cluster whose owner crashed left
        self._start("jobmanager", "jobmanager.sh")
        for i in range(taskmanagers):
            self.start_taskmanager(f"taskmanager-{i}")
        self.wait_slots(self.slots * taskmanagers, timeout_s)

    def start_taskmanager(self, name: str = "taskmanager-0") -> subprocess.Popen:
        return self._start(name, "taskmanager.sh")

    def kill(self, name: str) -> None:
        """``kill -9`` one process of the cluster (its whole process group: the JVM and its Python workers)."""
        proc = self.procs.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def rest(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://{self.address}{path}", timeout=5) as resp:  # noqa: S310 - our cluster
            return json.loads(resp.read())

    def wait_slots(self, slots: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise StackError(f"flink {name} exited with {proc.returncode}; see {self.root / 'log'}")
            try:
                if self.rest("/overview").get("slots-total", 0) >= slots:
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise StackError(f"the flink cluster did not offer {slots} slots within {timeout_s:.0f}s; "
                                 f"see {self.root / 'log'}")
            time.sleep(0.5)

    def jobs(self) -> list[dict]:
        return self.rest("/jobs/overview")["jobs"]

    def down(self) -> None:
        for name in list(self.procs):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _java_opts(home: Path) -> str:
    """The distribution's own JVM options (module opens Flink needs on Java 17)."""
    text = (home / "conf" / "config.yaml").read_text()
    for line in text.splitlines():
        if line.strip().startswith("all:") and "--add-opens" in line:
            return line.split("all:", 1)[1].strip()
    return ""


def runtime_zip(settings: StackSettings) -> Path:
    """The runtime's Python package as a zip with ``streams/`` at its top, for ``--pyFiles``: the workers put the
    zip itself on their path (a folder would put ``streams/``'s modules there, and its ``avro.py`` would hide
    the ``avro`` package Flink's own Python code imports)."""
    target = settings.home / "flink" / "streams.zip"
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted((SOURCE_ROOT / "streams").rglob("*.py")):
            archive.write(path, path.relative_to(SOURCE_ROOT).as_posix())
    return target


def submit_argv(settings: StackSettings, jobmanager: str, job_args: list[str], parallelism: int = 1,
                detached: bool = True) -> list[str]:
    """``flink run --python streams/flink/job.py`` against ``jobmanager`` (host:port of its REST endpoint): the
    job's jars ride in ``--jar`` (the job puts them in ``pipeline.jars``, shipped with the job), the runtime's
    Python code in ``--pyFiles``."""
    jars = [arg for jar in fetch_jars(settings) for arg in ("--jar", str(jar))]
    return ["bash", str(flink_home() / "bin" / "flink"), "run", *(["--detached"] if detached else []),
            "--jobmanager", jobmanager, "--parallelism", str(parallelism),
            "--pyFiles", str(runtime_zip(settings)), "--pyExecutable", str(flink_python()),
            "--pyClientExecutable", str(flink_python()),
            "--python", str(SOURCE_ROOT / "streams" / "flink" / "job.py"),  # the options end here: the job's follow
            *job_args, *jars, "--parallelism", str(parallelism)]


def submit(settings: StackSettings, jobmanager: str, job_args: list[str], parallelism: int = 1,
           log_path: Path | None = None, timeout_s: float = 300.0) -> str:
    """Submit the feature job (detached); returns the job id the client printed."""
    env = job_env(settings)  # the client builds the query: the Kafka connector's security comes from here
    env.setdefault("FLINK_CONF_DIR", str(flink_home() / "conf"))
    # the client's own temporary files (the job's artifacts zipped for upload), removed once it has submitted
    with tempfile.TemporaryDirectory(prefix="tangram-flink-submit-") as tmp:
        env.update({"TMPDIR": tmp, "JVM_ARGS": f"{env.get('JVM_ARGS', '')} -Djava.io.tmpdir={tmp}".strip()})
        result = subprocess.run(submit_argv(settings, jobmanager, job_args, parallelism), env=env,
                                capture_output=True, text=True, timeout=timeout_s, check=False)
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(result.stdout + result.stderr)
    for line in (result.stdout + result.stderr).splitlines():
        if "JobID" in line or "job id" in line.lower():
            job = line.strip().split()[-1]
            if len(job) == 32:
                return job
    raise StackError(f"flink run did not submit the job (exit {result.returncode}):\n"
                     f"{(result.stdout + result.stderr)[-3000:]}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="streams.flink.cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["up", "down", "submit"])
    p.add_argument("--jobmanager", help="host:port of a JobManager's REST endpoint (default: this machine's)")
    p.add_argument("--parallelism", type=int, default=1)
    p.add_argument("--taskmanagers", type=int, default=1)
    p.add_argument("--rest-port", type=int, default=FlinkCluster.rest_port, help="The local cluster's REST port.")
    p.add_argument("--rpc-port", type=int, default=FlinkCluster.rpc_port, help="The local cluster's RPC port.")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    job_args = argv[cut + 1:]  # after --: the arguments of streams.flink.job
    settings = StackSettings()
    cluster = FlinkCluster(settings, rest_port=args.rest_port, rpc_port=args.rpc_port)
    if args.command == "up":
        cluster.up(args.taskmanagers)
        print(f"flink cluster at http://{cluster.address} (logs: {cluster.root / 'log'})")
        signal.signal(signal.SIGTERM, lambda *_: cluster.down())
        try:
            while all(proc.poll() is None for proc in cluster.procs.values()):
                time.sleep(1)
        finally:
            cluster.down()
    elif args.command == "submit":
        print(submit(settings, args.jobmanager or cluster.address, job_args, args.parallelism))
    else:
        raise SystemExit("`down`: stop the `up` process (Ctrl-C or SIGTERM); it stops its JobManager and TaskManagers")


if __name__ == "__main__":
    main()
