"""An app's Triton model repository: built by the app (``tangram models build``), installed by ``tangram apply``.

An app folder holds its models' declarations (``model_repository/<model>/config.pbtxt``, the labels
file, ...); the artifacts (``<model>/<version>/model.onnx``, the model card, the baseline sample)
are built by the app's own ``models.build`` hook — a training or export script of its plugin code —
into that folder, or into any repository folder (a volume a model server mounts). ``tangram apply``
then installs each model into the stack's Triton repository (``TANGRAM_MODEL_REPOSITORY``) and has
Triton load it (explicit model control), so one model server serves every app applied to it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
from pathlib import Path

from streams.errors import InferenceError, TopologyError
from streams.settings import StackSettings
from streams.topology import Topology

log = logging.getLogger("tangram.lifecycle.repository")

CONFIG = "config.pbtxt"
#: What an app's build hook writes beside a model's versions: its training's account (dataset, metrics, baseline).
CARD_FILE = "model_card.json"


def model_dirs(repository: Path) -> list[Path]:
    """The model folders of a repository: those holding a ``config.pbtxt``, by name."""
    return sorted(p for p in repository.iterdir() if (p / CONFIG).is_file()) if repository.is_dir() else []


def _files(folder: Path) -> dict[str, str]:
    """Relative path → sha256 of every file under ``folder``."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _versions(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name.isdigit() and any(p.iterdir()))


def build_models(topology: Topology, repository: Path | None = None, force: bool = False) -> str:
    """Run the app's ``models.build`` hook into ``repository`` (default: the app's own model repository).

    A repository elsewhere (a model server's volume) first gets the app's declarations (every model
    folder as the app holds it); the hook then writes the artifacts there. Returns the hook's summary.
    """
    source = topology.model_repository
    if not model_dirs(source):
        raise TopologyError(f"app {topology.app!r} has no model in {source} (<model>/{CONFIG})")
    target = (repository or source).resolve()
    if target != source:
        for folder in model_dirs(source):
            shutil.copytree(folder, target / folder.name, dirs_exist_ok=True)
    if topology.models.build is None:
        missing = [f.name for f in model_dirs(target) if not _versions(f)]
        if missing:
            raise TopologyError(f"app {topology.app!r} declares no `models.build` and {', '.join(missing)} "
                                f"has no version folder in {target}")
        return f"nothing to build: the models of app {topology.app!r} are complete in {target}"
    build = topology.load_object(topology.models.build)
    return str(build(target, force=force))


def pending_installs(topology: Topology, stack: StackSettings) -> dict[str, str]:
    """Model → why `apply` installs it: not in the stack's repository yet, or a file of the app's copy differs.

    An app folder without artifacts (an image: they were built straight into the model server's repository
    with `tangram models build --repository`) is compared by its declarations alone. Raises TopologyError
    for a model built nowhere (run `tangram models build` first).
    """
    pending = {}
    for folder in model_dirs(topology.model_repository):
        installed = stack.model_repository / folder.name
        if not _versions(folder) and not (installed.is_dir() and _versions(installed)):
            raise TopologyError(f"model {folder.name!r} of app {topology.app!r} has no built version in {folder} "
                                f"or in {stack.model_repository}: run `tangram models build {topology.folder}` first")
        if not installed.is_dir():
            pending[folder.name] = f"versions {', '.join(_versions(folder))} into {stack.model_repository}"
            continue
        mine, theirs = _files(folder), _files(installed)
        changed = sorted(path for path, digest in mine.items() if theirs.get(path) != digest)
        if changed:
            pending[folder.name] = f"changed: {', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}"
    return pending


def install_models(topology: Topology, stack: StackSettings, models: list[str]) -> None:
    """Copy ``models`` of the app into the stack's repository and have a running Triton load each one."""
    for name in models:
        shutil.copytree(topology.model_repository / name, stack.model_repository / name, dirs_exist_ok=True)
        log.info("installed model %s of app %s into %s", name, topology.app, stack.model_repository)
    if models:
        asyncio.run(_load(stack, models))


async def _load(stack: StackSettings, models: list[str]) -> None:
    from inference_workers.triton_client import ModelRepository

    async with ModelRepository(stack.triton_grpc_url, load_timeout_s=stack.start_timeout_s,
                               control_key=stack.triton_key) as repository:
        try:
            await repository.index()
        except InferenceError as exc:  # not running: it loads the repository's models when it starts
            log.info("Triton not reachable at %s (%s): the models load when it starts", stack.triton_grpc_url, exc)
            return
        for name in models:
            await repository.load(name)
