"""Model lifecycle (seed node 7): the model registry on the compacted topic ``_tangram.models``.

* :mod:`streams.lifecycle.state`: versions, stages, admission rules, routing — a pure fold of events;
* :mod:`streams.lifecycle.registry`: :class:`ModelRegistry`, the writer (register, promote, rollback…);
* :mod:`streams.lifecycle.watcher`: :class:`ModelRegistryWatcher`, the live view inference workers embed;
* :mod:`streams.lifecycle.canary`: canary health (confidence p50), the schedule as a pure decision, the controller;
* :mod:`streams.lifecycle.canary_job`: :class:`~streams.lifecycle.canary_job.CanaryJob`, the processor that runs
  a model's canary from its prediction topic (topology kind ``streams.lifecycle.canary_job:CanaryJob``);
* :mod:`streams.lifecycle.artifacts`: sha256 checks before any load, registration from a model card;
* :mod:`streams.lifecycle.cli`: ``tangram models …``.
"""

from streams.lifecycle.artifacts import verify_artifact
from streams.lifecycle.registry import MODELS_TOPIC, ModelRegistry
from streams.lifecycle.state import ModelPolicy, ModelVersion, Routing, Stage, VersionRef
from streams.lifecycle.watcher import ModelRegistryWatcher

__all__ = ["MODELS_TOPIC", "ModelPolicy", "ModelRegistry", "ModelRegistryWatcher", "ModelVersion", "Routing",
           "Stage", "VersionRef", "verify_artifact"]
