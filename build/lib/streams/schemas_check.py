"""``tangram schemas check APP``: no incompatible change to a data contract reaches a deploy.

Every ``<subject>.avsc`` of an app's schema folder (its topology's ``schemas:``) is checked under
its subject's compatibility level (``compatibility.yaml`` in that folder, BACKWARD by default)
against the earlier versions of the same subject, taken either

* from git (default): every distinct committed version of the file, oldest first, the working
  copy being the candidate (when the working copy equals the last commit, that commit is the
  candidate and the versions before it are the history, so CI checks the commit it runs on); or
* from a schema registry (``--registry URL``): every version registered under the subject.

The rules are the Avro specification's schema resolution (``streams.registry.compatibility``),
so what passes here is what the embedded registry and Confluent's accept. A failure names the
subject, the field path and the rule broken.
"""

from __future__ import annotations

import logging
import subprocess
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from streams.errors import SchemaError
from streams.registry.compatibility import LEVELS, check_level, parse

log = logging.getLogger("tangram.schemas")

LEVELS_FILE = "compatibility.yaml"


class CompatibilityConfig(BaseModel):
    """``compatibility.yaml`` beside the schemas: the level of each subject."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    default: str = Field("BACKWARD", description="Level of every subject not listed under `subjects`.")
    subjects: dict[str, str] = Field(default_factory=dict, description="subject → level.")

    @field_validator("default")
    @classmethod
    def _known_default(cls, level: str) -> str:
        return _known(level)

    @field_validator("subjects")
    @classmethod
    def _known_levels(cls, subjects: dict[str, str]) -> dict[str, str]:
        return {subject: _known(level) for subject, level in subjects.items()}

    def level(self, subject: str) -> str:
        return self.subjects.get(subject, self.default)


def _known(level: str) -> str:
    if level.upper() not in LEVELS:
        raise ValueError(f"unknown compatibility level {level!r}; use one of {', '.join(LEVELS)}")
    return level.upper()


def load_levels(schema_dir: Path) -> CompatibilityConfig:
    """The declared levels; every subject named must have its ``.avsc`` file."""
    path = schema_dir / LEVELS_FILE
    if not path.is_file():
        return CompatibilityConfig()
    try:
        config = CompatibilityConfig.model_validate(yaml.safe_load(path.read_text()) or {})
    except (yaml.YAMLError, ValidationError) as exc:
        raise SchemaError(f"{path}: {exc}") from exc
    missing = sorted(s for s in config.subjects if not (schema_dir / f"{s}.avsc").is_file())
    if missing:
        raise SchemaError(f"{path} declares levels for {', '.join(missing)} with no .avsc file; remove them or add the schema")
    return config


@dataclass
class SubjectReport:
    """The outcome for one subject."""

    subject: str
    level: str
    compared_with: str  # e.g. "3 git versions", "registry versions 1-2", "nothing (new subject)"
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class History(ABC):
    """Where the earlier versions of a subject come from."""

    @abstractmethod
    def earlier(self, subject: str, path: Path, candidate: str) -> tuple[list[str], str]:
        """Earlier schema texts (oldest first) and a description of them."""


class GitHistory(History):
    """Earlier versions are the file's distinct committed versions (``git log --follow``)."""

    def __init__(self, repo: Path, ref: str = "HEAD"):
        self.repo = repo
        self.ref = ref
        probe = self._git("rev-parse", "--verify", f"{ref}^{{commit}}", check=False)
        if probe.returncode != 0:
            raise SchemaError(
                f"cannot read git history at {ref!r} in {repo}: {probe.stderr.strip() or probe.stdout.strip()}; "
                "run inside a git checkout, or compare with a registry (`tangram schemas check --registry URL`)"
            )

    @classmethod
    def around(cls, path: Path, ref: str = "HEAD") -> "GitHistory":
        """The history of the git checkout that holds ``path``."""
        top = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
        if top.returncode != 0:
            raise SchemaError(f"{path} is not inside a git checkout ({top.stderr.strip()}); compare with a registry "
                              "(`tangram schemas check APP --registry URL`)")
        return cls(Path(top.stdout.strip()), ref)

    def _git(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(["git", "-C", str(self.repo), *args], capture_output=True, text=True)
        if check and result.returncode != 0:
            raise SchemaError(f"git {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def earlier(self, subject: str, path: Path, candidate: str) -> tuple[list[str], str]:
        relative = path.resolve().relative_to(self.repo.resolve()).as_posix()
        commits = self._git("log", "--format=%H", "--follow", self.ref, "--", relative).stdout.split()
        versions: list[str] = []
        for commit in reversed(commits):  # oldest first
            shown = self._git("show", f"{commit}:{relative}", check=False)
            if shown.returncode == 0 and (not versions or shown.stdout != versions[-1]):
                versions.append(shown.stdout)
        if versions and versions[-1] == candidate:  # the candidate is the committed tip
            versions.pop()
        described = f"{len(versions)} earlier git version(s) up to {self.ref}" if versions else "nothing (new in git)"
        return versions, described


class RegistryHistory(History):
    """Earlier versions are the ones registered under the subject."""

    def __init__(self, url: str, timeout_s: float = 10.0):
        self.url = url
        self.client = SchemaRegistryClient({"url": url, "timeout": timeout_s})

    def earlier(self, subject: str, path: Path, candidate: str) -> tuple[list[str], str]:
        try:
            versions = self.client.get_versions(subject)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                return [], "nothing (not registered)"
            raise SchemaError(f"registry at {self.url} failed listing {subject}: {exc}") from exc
        except Exception as exc:  # connection refused, timeouts
            raise SchemaError(f"cannot reach the schema registry at {self.url}: {exc}; is the stack up (`tangram up`)?") from exc
        texts = [self.client.get_version(subject, v).schema.schema_str for v in sorted(versions)]
        if texts and _same_schema(texts[-1], candidate):
            texts.pop()
            return texts, f"registry versions before the latest ({len(texts)})"
        return texts, f"registry versions {min(versions)}-{max(versions)}"


def _same_schema(a: str, b: str) -> bool:
    try:
        return parse(a).root == parse(b).root
    except Exception:
        return a == b


def _valid(subject: str, text: str) -> bool:
    """Whether an earlier version parses; an invalid one never held data, so it constrains nothing."""
    try:
        parse(text)
    except Exception:
        log.warning("%s: skipping an earlier version that is not a valid Avro schema", subject)
        return False
    return True


def check_schemas(history: History, schema_dir: Path, subjects: list[str] | None = None) -> list[SubjectReport]:
    """Check every subject (or those named) in ``schema_dir``; one report per subject."""
    levels = load_levels(schema_dir)
    files = sorted(schema_dir.glob("*.avsc"))
    if subjects:
        unknown = sorted(set(subjects) - {f.stem for f in files})
        if unknown:
            raise SchemaError(f"no schema file for {', '.join(unknown)} in {schema_dir}")
        files = [f for f in files if f.stem in subjects]
    reports = []
    for path in files:
        subject, level = path.stem, levels.level(path.stem)
        candidate = path.read_text()
        try:
            parse(candidate)
        except Exception as exc:
            reports.append(SubjectReport(subject, level, "-", [f"{path.name} is not a valid Avro schema: {exc}"]))
            continue
        earlier, described = history.earlier(subject, path, candidate)
        earlier = [old for old in earlier if _valid(subject, old)]
        problems = [f"{subject}: {m}" for m in check_level(level, candidate, earlier)]
        reports.append(SubjectReport(subject, level, described, problems))
    return reports
