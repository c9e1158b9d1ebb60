"""The inference worker's version switch without Triton: load the new, switch, unload the old; retries.

Uses the in-process fakes of test_worker_decisions (a fake model per version, a fake repository for
Triton's explicit model control); tests/integration/test_worker.py runs the same switches on the real
Triton and Kafka.
"""

from __future__ import annotations

import json

from inference_workers.routing import ModelTarget
from streams.errors import InferenceError, InferenceUnavailableError

from test_worker_decisions import FakeRepository, make_worker, predictions, records, window


class FlakyRepository(FakeRepository):
    """Refuses the first ``failures`` loads with ``error`` (Triton down, or Triton refusing the version)."""

    def __init__(self, fakes, failures: int, error: Exception):
        super().__init__(fakes)
        self.failures = failures
        self.error = error

    async def serve(self, model: str, versions: set[str]) -> set[str]:
        if "2" in versions and self.failures > 0:
            self.failures -= 1
            self.calls.append(("refused", model, sorted(versions)))
            raise self.error
        return await super().serve(model, versions)


def version_of(worker, batch) -> str:
    (prediction,) = predictions(worker, worker.process(batch))
    return prediction["model_version"]


def test_a_switch_triton_cannot_take_yet_waits_and_is_retried_between_batches(tmp_path) -> None:
    path = tmp_path / "routing.json"
    path.write_text(json.dumps({"production": "1"}))
    worker, fakes = make_worker(routing_file=str(path))
    worker.serving.repository = FlakyRepository(fakes, failures=2, error=InferenceUnavailableError("Triton is unavailable"))
    batch = records(worker, [window("dev-1", 0)])
    assert version_of(worker, batch) == "1"
    worker.serving.models[ModelTarget("anomaly", "2")] = fakes[ModelTarget("anomaly", "2")]
    path.write_text(json.dumps({"production": "2"}) + " ")
    assert version_of(worker, batch) == "1"  # Triton down: the routing stays, the change waits
    assert version_of(worker, batch) == "1"  # second try refused too
    assert version_of(worker, batch) == "2"  # third try: loaded, switched
    assert [c[0] for c in worker.serving.repository.calls] == ["serve", "refused", "refused", "serve", "retire"]
    assert worker.serving.repository.calls[-1] == ("retire", "anomaly", ["1"])


def test_a_version_triton_refuses_is_not_retried_and_the_routing_stays(tmp_path) -> None:
    path = tmp_path / "routing.json"
    path.write_text(json.dumps({"production": "1"}))
    worker, fakes = make_worker(routing_file=str(path))
    worker.serving.repository = FlakyRepository(fakes, failures=1, error=InferenceError("version 2 is UNAVAILABLE: bad file"))
    batch = records(worker, [window("dev-1", 0)])
    assert version_of(worker, batch) == "1"
    path.write_text(json.dumps({"production": "2"}) + " ")
    assert version_of(worker, batch) == "1"
    assert version_of(worker, batch) == "1"
    assert [c[0] for c in worker.serving.repository.calls] == ["serve", "refused"]  # no retry, nothing unloaded


def test_ready_applies_a_waiting_switch_and_has_the_routed_versions_loaded(tmp_path) -> None:
    """What a replica does while paused: switch if a change arrived, else get its versions loaded again."""
    path = tmp_path / "routing.json"
    path.write_text(json.dumps({"production": "1"}))
    worker, fakes = make_worker(routing_file=str(path))
    batch = records(worker, [window("dev-1", 0)])
    assert version_of(worker, batch) == "1"
    assert worker.ready()
    assert worker.serving.repository.calls[-1] == ("serve", "anomaly", ["1"])  # (re)load what the routing needs
    worker.serving.models[ModelTarget("anomaly", "2")] = fakes[ModelTarget("anomaly", "2")]
    path.write_text(json.dumps({"production": "2"}) + " ")
    assert worker.ready()  # the change is applied before the put-back batch is retried
    assert worker.serving.plan.production == ModelTarget("anomaly", "2")
    assert ("retire", "anomaly", ["1"]) in worker.serving.repository.calls
    assert version_of(worker, batch) == "2"


class Verified:
    """The registry watcher's digest check, passed (test_worker_registry.py runs the real one)."""

    def verified_path(self, model, ref, repository):
        return repository


def test_the_previous_production_stays_loaded_so_a_rollback_is_a_routing_switch() -> None:
    from streams.lifecycle.state import Routing, VersionRef

    worker, fakes = make_worker()
    worker.serving.watcher = Verified()
    fakes[ModelTarget("anomaly", "3")] = fakes[ModelTarget("anomaly", "2")]
    ref = {v: VersionRef(version=v, sha256="0" * 64, artifact=f"anomaly/{v}/model.onnx", framework="onnx") for v in "123"}
    batch = records(worker, [window("dev-1", 0)])
    assert version_of(worker, batch) == "1"

    worker.serving.models.update(fakes)  # the worker's clients of each version (it closes those it stops routing)
    worker.serving.on_registry_change(None, Routing(model="anomaly", production=ref["2"], standby=ref["1"]))  # promote 2
    assert version_of(worker, batch) == "2"
    assert not any(c[0] == "retire" and "1" in c[2] for c in worker.serving.repository.calls)  # 1 kept as standby
    assert ("serve", "anomaly", ["1"]) in worker.serving.repository.calls

    worker.serving.models.update(fakes)  # the worker's clients of each version (it closes those it stops routing)
    worker.serving.on_registry_change(None, Routing(model="anomaly", production=ref["3"], standby=ref["2"]))  # promote 3
    assert version_of(worker, batch) == "3"
    retired = [v for c in worker.serving.repository.calls if c[0] == "retire" for v in c[2]]
    assert "1" in retired and "2" not in retired  # the old standby goes, the new one stays

    worker.serving.repository.calls.clear()
    worker.serving.models.update(fakes)  # the worker's clients of each version (it closes those it stops routing)
    worker.serving.on_registry_change(None, Routing(model="anomaly", production=ref["2"]))  # rollback to 2
    assert version_of(worker, batch) == "2"
    assert worker.serving.repository.calls[0] == ("serve", "anomaly", ["2"])  # already loaded: FakeRepository loads nothing


def test_a_routing_over_models_per_server_is_refused_and_the_routing_stays(tmp_path) -> None:
    path = tmp_path / "routing.json"
    path.write_text(json.dumps({"production": "1"}))
    worker, fakes = make_worker(routing_file=str(path))
    worker.serving.models_per_server = 1  # the topology's state.models_per_server
    batch = records(worker, [window("dev-1", 0)])
    assert version_of(worker, batch) == "1"
    path.write_text(json.dumps({"production": "1", "challenger": "2", "mode": "canary", "canary_share": 0.5}) + " ")
    worker.process(batch)
    assert worker.serving.plan.challenger is None  # two versions side by side would exceed 1
    assert [c[0] for c in worker.serving.repository.calls] == ["serve"]  # nothing loaded for it
