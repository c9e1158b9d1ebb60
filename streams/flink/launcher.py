"""Start the PyFlink feature job from the application environment.

``fetch_jars`` resolves the connector jars of ``streams/flink/pom.xml`` with Maven (cached in
``~/.m2``) and builds the job's function jar into ``<home>/flink/lib``; ``job_argv`` is the command line of
the job on a local mini-cluster, run by the Flink environment's interpreter (``.venv-flink``, or
``TANGRAM_FLINK_PYTHON``); ``run_job`` runs it to the end (bounded input) with a deadline.

    python -m streams.flink.launcher jars
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import streams
from streams.errors import StackError
from streams.security.kafka import ENV as KAFKA_SECURITY_ENV
from streams.settings import StackSettings, revealed

log = logging.getLogger("tangram.flink")

#: Package data, copied next to the jars before Maven runs (Maven writes ``target/`` beside its pom).
POM = Path(__file__).with_name("pom.xml")
#: The job's JVM function (``CONFLUENT_AVRO``): a Maven project built into ``UDF_JAR``.
UDF = Path(__file__).with_name("udf")
UDF_JAR = "tangram-flink-udf.jar"
#: The folder holding the ``streams`` package: the job's Python workers import the feature-set code from it.
SOURCE_ROOT = Path(streams.__file__).resolve().parent.parent
_STAMP = ".pom.sha256"


def flink_python() -> Path:
    """The Flink environment's interpreter (``TANGRAM_FLINK_PYTHON``); StackError naming `make setup` when missing."""
    python = StackSettings().flink_python
    if not python.exists():
        raise StackError(f"the Flink environment interpreter {python} is missing: run `make setup`")
    return python


def lib_dir(settings: StackSettings) -> Path:
    return settings.home / "flink" / "lib"


def _digest() -> str:
    """What the jars are made from: the pom, and the function's pom and sources."""
    h = hashlib.sha256(POM.read_bytes())
    for path in sorted(UDF.rglob("*")):
        if path.is_file() and "target" not in path.parts:
            h.update(str(path.relative_to(UDF)).encode() + path.read_bytes())
    return h.hexdigest()


def fetch_jars(settings: StackSettings) -> list[Path]:
    """The connector and format jars, resolved by Maven, and the job's function jar, built by Maven from
    ``udf/``, in ``<home>/flink/lib`` unless already there from these sources."""
    lib = lib_dir(settings)
    digest = _digest()
    stamp = lib / _STAMP
    if not (stamp.is_file() and stamp.read_text().strip() == digest):
        mvn = shutil.which("mvn")
        if mvn is None:
            raise StackError("Maven is required to fetch the Flink connector jars: install it (apt-get install maven)")
        staging = lib.with_name("lib.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        pom = lib.parent / "pom.xml"
        pom.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(POM, pom)
        build = lib.parent / "udf"
        shutil.rmtree(build, ignore_errors=True)
        shutil.copytree(UDF, build, ignore=shutil.ignore_patterns("target"))
        for cmd, made in (([mvn, "-q", "-B", "-f", str(pom), "dependency:copy-dependencies", "-DincludeScope=runtime",
                            f"-DoutputDirectory={staging}"], lambda: any(staging.glob("flink-sql-connector-kafka-*.jar"))),
                          ([mvn, "-q", "-B", "-f", str(build / "pom.xml"), "package"],
                           lambda: (build / "target" / UDF_JAR).is_file())):
            result = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if result.returncode != 0 or not made():
                shutil.rmtree(staging, ignore_errors=True)
                raise StackError(f"maven could not make the flink jars ({' '.join(cmd)}):\n"
                                 f"{(result.stdout + result.stderr)[-3000:]}")
        shutil.copyfile(build / "target" / UDF_JAR, staging / UDF_JAR)
        (staging / _STAMP).write_text(digest + "\n")
        shutil.rmtree(lib, ignore_errors=True)
        staging.rename(lib)
        log.info("flink jars ready in %s", lib)
    return sorted(lib.glob("*.jar"))


def job_argv(settings: StackSettings, *, feature_set: str, dlq: str, group: str, source: str | None = None,
             output: str | None = None, table: str | None = None, bounded: bool = False,
             online_project: str | None = None, parallelism: int = 1) -> list[str]:
    """The command line of the Flink job against ``settings``'s stack (and its Redis when ``online_project``)."""
    argv = [str(flink_python()), "-m", "streams.flink.job", "--bootstrap", settings.bootstrap_servers,
            "--registry", settings.registry_url, "--dlq", dlq, "--group", group, "--feature-set", feature_set]
    for jar in fetch_jars(settings):
        argv += ["--jar", str(jar)]
    if online_project:
        argv += ["--redis", settings.redis_url, "--project", online_project]
    for flag, value in (("--source", source), ("--output", output), ("--table", table)):
        if value:
            argv += [flag, value]
    return argv + ["--parallelism", str(parallelism)] + (["--bounded"] if bounded else [])


def job_env(settings: StackSettings | None = None) -> dict[str, str]:
    """The job's environment: the runtime's source on PYTHONPATH (the mini-cluster's Python workers inherit it),
    and ``settings``'s Kafka security as ``TANGRAM_KAFKA_SECURITY`` (the job renders it into the Kafka
    connector's ``properties.*``: the Flink environment has no pydantic-settings to read a stack's settings)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE_ROOT), env.get("PYTHONPATH", "")) if p)
    if settings is not None and settings.kafka.security.secured:
        for name in [k for k in env if k.startswith(f"{KAFKA_SECURITY_ENV}__")]:
            del env[name]  # the settings' security whole, not mixed with another principal's fields
        env[KAFKA_SECURITY_ENV] = json.dumps(revealed(settings.kafka.security), default=str)
    return env


def run_job(argv: list[str], timeout_s: float, log_path: Path, settings: StackSettings | None = None) -> None:
    """Run a bounded job to its end (as ``settings``'s Kafka principal, if given); StackError with the log's
    tail if it fails or overruns."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as out:
        proc = subprocess.Popen(argv, env=job_env(settings), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise StackError(f"flink job did not finish in {timeout_s:.0f}s; log: {log_path}\n"
                             f"{log_path.read_text(errors='replace')[-3000:]}") from None
    if rc != 0:
        raise StackError(f"flink job failed (exit {rc}); log: {log_path}\n{log_path.read_text(errors='replace')[-3000:]}")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args != ["jars"]:
        raise SystemExit("usage: python -m streams.flink.launcher jars")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    jars = fetch_jars(StackSettings())
    print("\n".join(str(j) for j in jars))


if __name__ == "__main__":
    main()
