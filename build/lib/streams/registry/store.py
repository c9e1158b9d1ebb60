"""In-memory state of the schema registry, rebuilt from (and changed only through) log records.

The registry's source of truth is the compacted ``_schemas`` topic. Every change is expressed
as :class:`~streams.statelog.LogRecord` values (a JSON key and a JSON value, ``None`` for a tombstone), shaped like
Confluent's so compaction keeps what matters:

* ``{"keytype": "SCHEMA", "subject": s, "version": v, "magic": 1}`` →
  ``{"subject", "version", "id", "schema", "schemaType", "deleted"}`` (tombstone = hard delete);
* ``{"keytype": "CONFIG", "subject": s | null, "magic": 0}`` → ``{"compatibilityLevel": L}``
  (tombstone = subject level removed, global level back to the default);
* ``{"keytype": "ID_FLOOR", "magic": 0}`` → ``{"max_id": n}``, written on hard deletes so an id
  is never handed out twice even after compaction drops the tombstoned schema.

:class:`SchemaRegistryState` methods that change something do not mutate: they validate, then
return the records to append. The caller appends them to the log and only then calls
:meth:`SchemaRegistryState.apply` on each, exactly as replay does, so live state and replayed state
cannot diverge. Nothing here touches Kafka, which keeps it unit-testable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from streams.errors import SchemaError
from streams.registry import compatibility
from streams.statelog import LogRecord

DEFAULT_LEVEL = "BACKWARD"
MAX_VERSION = 2**31 - 1


class RegistryError(SchemaError):
    """A request the registry refuses, with Confluent's HTTP status and error code."""

    def __init__(self, status: int, error_code: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_code = error_code
        self.message = message


def subject_not_found(subject: str) -> RegistryError:
    return RegistryError(404, 40401, f"Subject '{subject}' not found.")


def version_not_found(subject: str, version: int | str) -> RegistryError:
    return RegistryError(404, 40402, f"Version {version} not found.")


def schema_not_found(detail: str = "Schema not found") -> RegistryError:
    return RegistryError(404, 40403, detail)


def invalid_schema(detail: str) -> RegistryError:
    return RegistryError(422, 42201, f"Invalid schema: {detail}")


def invalid_version(version: Any) -> RegistryError:
    return RegistryError(
        422,
        42202,
        f"The specified version '{version}' is not a valid version id. "
        'Allowed values are between [1, 2^31-1] and the string "latest"',
    )


def invalid_level(level: Any) -> RegistryError:
    return RegistryError(
        422,
        42203,
        f"Invalid compatibility level '{level}'. Valid values are none, backward, forward, full, "
        "backward_transitive, forward_transitive, and full_transitive",
    )


@dataclass
class SchemaVersion:
    """A schema registered under a subject at a version."""

    subject: str
    version: int
    id: int
    schema: str
    deleted: bool = False

    def to_response(self) -> dict[str, Any]:
        """Body of ``GET /subjects/{s}/versions/{v}`` (schemaType omitted for AVRO, like Confluent)."""
        return {"subject": self.subject, "version": self.version, "id": self.id, "schema": self.schema}


def normalize(schema: str) -> str:
    """Validate an Avro schema and return the compact JSON text that the registry stores.

    Key order is kept (it is what the client sent); whitespace is dropped.
    """
    try:
        obj = json.loads(schema)
        compatibility.parse(schema)
    except Exception as exc:  # json or fastavro parse error: both mean "invalid schema"
        raise invalid_schema(f"{type(exc).__name__}: {exc}") from exc
    return json.dumps(obj, separators=(",", ":"))


def identity(schema: str) -> str:
    """The key under which two schema texts are "the same schema" (same global id)."""
    return json.dumps(json.loads(schema), sort_keys=True, separators=(",", ":"))


def schema_key(subject: str, version: int) -> dict[str, Any]:
    return {"keytype": "SCHEMA", "subject": subject, "version": version, "magic": 1}


def config_key(subject: str | None) -> dict[str, Any]:
    return {"keytype": "CONFIG", "subject": subject, "magic": 0}


ID_FLOOR_KEY: dict[str, Any] = {"keytype": "ID_FLOOR", "magic": 0}


@dataclass
class SchemaRegistryState:
    """Subjects, versions, global schema ids and compatibility levels."""

    subjects: dict[str, dict[int, SchemaVersion]] = field(default_factory=dict)
    configs: dict[str | None, str] = field(default_factory=dict)  # None = global level
    max_id: int = 0

    # ---- applying log records -------------------------------------------------------------

    def apply(self, record: LogRecord) -> None:
        """Apply one log record (replayed or freshly written). Unknown key types are ignored."""
        key, value = record.key, record.value
        keytype = key.get("keytype")
        if keytype == "SCHEMA":
            subject, version = key["subject"], int(key["version"])
            versions = self.subjects.setdefault(subject, {})
            if value is None:
                versions.pop(version, None)
                if not versions:
                    del self.subjects[subject]
            else:
                versions[version] = SchemaVersion(
                    subject, version, int(value["id"]), value["schema"], bool(value.get("deleted", False))
                )
                self.max_id = max(self.max_id, int(value["id"]))
        elif keytype == "CONFIG":
            if value is None:
                self.configs.pop(key.get("subject"), None)
            else:
                self.configs[key.get("subject")] = value["compatibilityLevel"]
        elif keytype == "ID_FLOOR" and value is not None:
            self.max_id = max(self.max_id, int(value["max_id"]))

    # ---- queries --------------------------------------------------------------------------

    def _all_versions(self) -> list[SchemaVersion]:
        return [sv for versions in self.subjects.values() for sv in versions.values()]

    def schema_by_id(self, schema_id: int) -> str:
        """The schema text of a global id (soft-deleted versions still resolve, like Confluent)."""
        for sv in self._all_versions():
            if sv.id == schema_id:
                return sv.schema
        raise schema_not_found(f"Schema {schema_id} not found")

    def versions_of_id(self, schema_id: int, deleted: bool = False) -> list[SchemaVersion]:
        """Every subject-version that holds a global id."""
        self.schema_by_id(schema_id)
        found = [sv for sv in self._all_versions() if sv.id == schema_id and (deleted or not sv.deleted)]
        return sorted(found, key=lambda sv: (sv.subject, sv.version))

    def subject_names(self, deleted: bool = False, prefix: str = "") -> list[str]:
        return sorted(
            s
            for s, versions in self.subjects.items()
            if s.startswith(prefix) and any(deleted or not sv.deleted for sv in versions.values())
        )

    def versions(self, subject: str, deleted: bool = False) -> list[SchemaVersion]:
        """Versions of a subject, oldest first; 40401 if it has none (live ones unless ``deleted``)."""
        found = [sv for _, sv in sorted(self.subjects.get(subject, {}).items()) if deleted or not sv.deleted]
        if not found:
            raise subject_not_found(subject)
        return found

    def get_version(self, subject: str, version: int | str, deleted: bool = False) -> SchemaVersion:
        """One version; ``version`` is an int, its text, ``"latest"`` or -1."""
        number = parse_version(version)
        live = self.versions(subject, deleted)
        if number == -1:
            return live[-1]
        for sv in live:
            if sv.version == number:
                return sv
        raise version_not_found(subject, number)

    def lookup(self, subject: str, schema: str, deleted: bool = False) -> SchemaVersion:
        """The version of ``subject`` that holds this schema (``POST /subjects/{s}``)."""
        live = self.versions(subject, deleted)
        wanted = identity(normalize(schema))
        for sv in reversed(live):
            if identity(sv.schema) == wanted:
                return sv
        raise schema_not_found()

    def level(self, subject: str | None = None) -> str:
        """Effective compatibility level of a subject (its own, else the global one)."""
        if subject is not None and subject in self.configs:
            return self.configs[subject]
        return self.configs.get(None, DEFAULT_LEVEL)

    def incompatibilities(self, subject: str, schema: str, version: int | str | None = None) -> list[str]:
        """Messages from checking ``schema`` against a subject under its level.

        ``version=None`` checks what registration would check (the level's versions);
        a specific version (or ``"latest"``) checks against that one under the level's direction.
        """
        normalized = normalize(schema)
        level = self.level(subject)
        if version is None:
            earlier = [sv.schema for _, sv in sorted(self.subjects.get(subject, {}).items()) if not sv.deleted]
        else:
            earlier = [self.get_version(subject, version).schema]
            level = level.removesuffix("_TRANSITIVE")
        return compatibility.check_level(level, normalized, earlier)

    # ---- changes: return the records to append -------------------------------------------

    def register(self, subject: str, schema: str) -> tuple[SchemaVersion, list[LogRecord]]:
        """Register ``schema`` under ``subject``; no records if it is already there.

        Raises 409 with the compatibility messages when the subject's level refuses it.
        """
        normalized = normalize(schema)
        wanted = identity(normalized)
        existing = self.subjects.get(subject, {})
        for sv in sorted(existing.values(), key=lambda v: v.version):
            if not sv.deleted and identity(sv.schema) == wanted:
                return sv, []
        messages = self.incompatibilities(subject, normalized)
        if messages:
            raise RegistryError(
                409,
                409,
                f"Schema being registered is incompatible with an earlier schema for subject "
                f'"{subject}", details: {messages}',
            )
        schema_id = next((sv.id for sv in self._all_versions() if identity(sv.schema) == wanted), self.max_id + 1)
        version = max(existing, default=0) + 1
        sv = SchemaVersion(subject, version, schema_id, normalized)
        value = {"subject": subject, "version": version, "id": schema_id, "schema": normalized,
                 "schemaType": "AVRO", "deleted": False}
        return sv, [LogRecord(schema_key(subject, version), value)]

    def delete_version(self, subject: str, version: int | str, permanent: bool) -> tuple[int, list[LogRecord]]:
        """Soft-delete one version, or hard-delete one already soft-deleted."""
        sv = self.get_version(subject, version, deleted=permanent)
        if not permanent:
            return sv.version, [self._soft_deleted(sv)]
        if not sv.deleted:
            raise RegistryError(
                404, 40407, f"Subject '{subject}' Version {sv.version} was not deleted first before being permanently deleted"
            )
        return sv.version, [LogRecord(schema_key(subject, sv.version), None), self._id_floor()]

    def delete_subject(self, subject: str, permanent: bool) -> tuple[list[int], list[LogRecord]]:
        """Soft-delete every version of a subject, or hard-delete a soft-deleted subject."""
        every = self.versions(subject, deleted=True)
        live = [sv for sv in every if not sv.deleted]
        if not permanent:
            if not live:
                raise RegistryError(404, 40404, f"Subject '{subject}' was soft deleted. Set permanent=true to delete permanently")
            return [sv.version for sv in live], [self._soft_deleted(sv) for sv in live]
        if live:
            raise RegistryError(
                404, 40405, f"Subject '{subject}' was not deleted first before being permanently deleted"
            )
        records = [LogRecord(schema_key(subject, sv.version), None) for sv in every]
        if subject in self.configs:
            records.append(LogRecord(config_key(subject), None))
        return [sv.version for sv in every], [*records, self._id_floor()]

    def set_level(self, subject: str | None, level: Any) -> tuple[str, list[LogRecord]]:
        """Set the global level (``subject=None``) or a subject's level."""
        if not isinstance(level, str) or level.upper() not in compatibility.LEVELS:
            raise invalid_level(level)
        level = level.upper()
        return level, [LogRecord(config_key(subject), {"compatibilityLevel": level})]

    def delete_level(self, subject: str | None) -> tuple[str, list[LogRecord]]:
        """Remove a subject's level (or reset the global one); returns the level it had."""
        if subject is not None and subject not in self.subjects and subject not in self.configs:
            raise subject_not_found(subject)
        previous = self.level(subject)
        return previous, [LogRecord(config_key(subject), None)]

    def _soft_deleted(self, sv: SchemaVersion) -> LogRecord:
        value = {"subject": sv.subject, "version": sv.version, "id": sv.id, "schema": sv.schema,
                 "schemaType": "AVRO", "deleted": True}
        return LogRecord(schema_key(sv.subject, sv.version), value)

    def _id_floor(self) -> LogRecord:
        return LogRecord(ID_FLOOR_KEY, {"max_id": self.max_id})


def parse_version(version: int | str) -> int:
    """A version number, -1 for ``latest``; 42202 for anything else."""
    if isinstance(version, str):
        if version == "latest":
            return -1
        try:
            version = int(version)
        except ValueError:
            raise invalid_version(version) from None
    if version == -1 or 1 <= version <= MAX_VERSION:
        return version
    raise invalid_version(version)
