"""Installed like a library, laid out like the image: the built wheel in a fresh virtual environment, run from a
folder outside the repository that holds what the Dockerfile copies under /app, against the real stack.

There is no Docker engine here, so this is how the image is proved: the same wheel, the same folders, the same
commands the compose services run (`models build`, `plan`, `apply`, every processor, `verify` steps 1-3), for
the reference app; and a scaffolded app through to an action.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer

from conftest import stack_env
from reference import REPO

pytestmark = pytest.mark.integration

UV = Path(sys.executable).with_name("uv")


def _copied_under_app() -> list[str]:
    """The sources the Dockerfile copies into /app (the COPY lines after `WORKDIR /app`)."""
    text = (REPO / "Dockerfile").read_text()
    final = text[text.index("WORKDIR /app"):]
    return re.findall(r"^COPY (\S+) \./\S+$", final, re.M)


def _run(argv: list[str], env: dict, cwd: Path, timeout: float = 300) -> str:
    result = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def image(stack, tmp_path_factory):
    """(tangram executable, /app-like folder, environment): the wheel installed outside the repository."""
    root = tmp_path_factory.mktemp("image")
    _run([str(UV), "build", "--wheel", "--out-dir", str(root / "dist"), str(REPO)], dict(os.environ), root, 600)
    (wheel,) = (root / "dist").glob("tangram-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "streams/stack/maven/kafka-pom.xml" in names and "streams/deploy/chart/templates/processors.yaml" in names
    assert not [n for n in names if n.startswith(("topologies/", "pm_app/", "tests/", "schemas/"))], "an app in the wheel"
    _run([str(UV), "venv", "-q", "-p", sys.executable, str(root / "venv")], dict(os.environ), root)
    _run([str(UV), "pip", "install", "-q", "-p", str(root / "venv" / "bin" / "python"), str(wheel)],
         dict(os.environ), root, 600)
    app = root / "app"
    for source in _copied_under_app():
        shutil.copytree(REPO / source, app / source, ignore=shutil.ignore_patterns(
            "__pycache__", "*.onnx", "model_card.json", "baseline.npz"))  # .dockerignore keeps artifacts out
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(stack_env(stack), TANGRAM_TRITON_PYTHON=str(stack.triton_python), PATH=f"{root / 'venv' / 'bin'}:{env['PATH']}")
    return root / "venv" / "bin" / "tangram", app, env


def test_the_reference_app_runs_from_the_installed_wheel_as_the_image_runs_it(image, stack):
    tangram, app, env = image
    pm = app / "topologies" / "predictive_maintenance"
    assert not any(pm.rglob("*.onnx")), "the image holds no built artifact: the models service builds them"
    # as docker-compose does it: the one-shot `models` service builds into the model server's repository,
    # `apply --no-models` makes topics and schemas, the processors read the artifacts from that repository
    print(_run([str(tangram), "models", "build", str(pm), "--repository", str(stack.model_repository)], env, app))
    assert (stack.model_repository / "anomaly" / "1" / "model.onnx").is_file()
    planned = _run([str(tangram), "plan", str(pm), "--no-models"], env, app)
    assert "plan for" in planned
    _run([str(tangram), "apply", str(pm), "--no-models"], env, app)
    # every processor of the app starts and joins its group, and steps 1-3 of verify pass: a valid reading
    # accepted and a malformed one dead-lettered, every declared service and the model's contract, a worn
    # bearing to a maintenance action within the SLA
    checked = _run([str(tangram), "verify", str(pm), "--steps", "1,2,3"], env, app, timeout=600)
    assert re.search(r"3 chain.*pass", checked, re.S), checked
    assert "FAIL" not in checked, checked


def test_a_scaffolded_app_runs_from_the_installed_wheel_through_to_an_action(image, stack):
    tangram, app, env = image
    _run([str(tangram), "init", "depot", "--dir", "depot"], env, app)
    _run([str(tangram), "models", "build", "depot"], env, app)
    _run([str(tangram), "apply", "depot"], env, app)
    processes = [subprocess.Popen([str(tangram), "run", "depot", name], env=env, cwd=app, start_new_session=True,
                                  stdout=subprocess.DEVNULL, stderr=(app / f"{name}.log").open("wb"))
                 for name in ("ingest", "features", "inference", "rules")]
    try:
        consumer = Consumer({"bootstrap.servers": stack.bootstrap_servers, "group.id": f"t-{uuid.uuid4().hex}",
                             "auto.offset.reset": "earliest"})
        consumer.subscribe(["depot.actions.alert"])
        producer = Producer({"bootstrap.servers": stack.bootstrap_servers})
        now = int(time.time() * 1000)
        for i in range(14):
            event = {"event_id": f"e{i}-{now}", "entity": "bin-7", "ts": now - 14_000 + i * 1000, "value": 90.0}
            producer.produce("depot.raw.events", json.dumps(event).encode(), "bin-7")
        assert producer.flush(30) == 0
        deadline, action = time.monotonic() + 120, None
        while action is None and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and not msg.error():
                action = msg
            for p in processes:
                assert p.poll() is None, (app / f"{p.args[3]}.log").read_text()[-3000:]
        consumer.close()
        assert action is not None and action.key() == b"bin-7", "no alert within 120 s"
    finally:
        for p in processes:
            os.killpg(p.pid, signal.SIGTERM)
        for p in processes:
            p.wait(30)
