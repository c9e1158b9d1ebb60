"""Avro schema compatibility: can a reader schema read data written with a writer schema?

This follows the Avro specification's schema-resolution rules (and the incompatibility names
of Avro Java's ``SchemaCompatibility``, which Confluent Schema Registry reports):

* primitives match themselves; promotions int→long→float→double and string↔bytes;
* records match by full name (or a reader alias); every reader field is either found in the
  writer (by name or reader field alias) with a readable type, or has a default;
  writer-only fields are skipped;
* enums match by name; writer symbols missing from the reader need a reader enum default;
* fixed match by name and size; arrays by items; maps by values;
* a writer union needs every branch readable; a reader union needs one branch that reads
  the writer.

:func:`check` is pure; :func:`check_level` applies a compatibility level (BACKWARD, FORWARD,
FULL, NONE and the ``*_TRANSITIVE`` variants) against earlier versions of a subject.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import fastavro

LEVELS: tuple[str, ...] = (
    "NONE",
    "BACKWARD",
    "BACKWARD_TRANSITIVE",
    "FORWARD",
    "FORWARD_TRANSITIVE",
    "FULL",
    "FULL_TRANSITIVE",
)

_PROMOTIONS: dict[str, frozenset[str]] = {
    # writer type -> reader types that can read it
    "int": frozenset({"long", "float", "double"}),
    "long": frozenset({"float", "double"}),
    "float": frozenset({"double"}),
    "string": frozenset({"bytes"}),
    "bytes": frozenset({"string"}),
}
_NAMED = ("record", "error", "enum", "fixed")

Schema = Any  # parsed Avro schema: str | list | dict, with full names (fastavro.parse_schema)


@dataclass
class _Side:
    """One parsed schema and the named types it defines."""

    root: Schema
    names: dict[str, Schema] = field(default_factory=dict)

    def resolve(self, node: Schema) -> Schema:
        """Replace a reference to a named type by its definition."""
        if isinstance(node, str) and node in self.names:
            return self.names[node]
        if isinstance(node, dict) and node.get("type") not in (*_NAMED, "array", "map"):
            return self.resolve(node["type"])  # {"type": "int", "logicalType": "date"}, {"type": "a.Named"}
        return node


def parse(schema: str | Schema) -> _Side:
    """Parse (and validate) an Avro schema given as JSON text (any ``str``) or as a decoded dict/list.

    Raises ``fastavro`` parse errors or ``json.JSONDecodeError`` when the schema is invalid.
    """
    obj = json.loads(schema) if isinstance(schema, str) else schema
    _require_fields(obj)
    names: dict[str, Schema] = {}
    root = fastavro.parse_schema(obj, named_schemas=names, _write_hint=False)
    return _Side(root, names)


def _require_fields(node: Schema) -> None:
    """fastavro accepts a record without ``fields``; the Avro specification does not."""
    if isinstance(node, list):
        for branch in node:
            _require_fields(branch)
    elif isinstance(node, dict):
        if node.get("type") in ("record", "error") and not isinstance(node.get("fields"), list):
            raise ValueError(f"record {node.get('name')!r} needs a 'fields' list")
        for value in (node.get("type"), node.get("items"), node.get("values"), *(node.get("fields") or [])):
            _require_fields(value)


def check(reader_schema: str | Schema, writer_schema: str | Schema) -> list[str]:
    """Messages explaining why ``reader_schema`` cannot read data written with ``writer_schema``.

    Each message names the path of the offending field (``Record.field.subfield``) and the rule
    broken. An empty list means compatible.
    """
    reader, writer = parse(reader_schema), parse(writer_schema)
    return _Checker(reader, writer).run()


def check_level(level: str, new_schema: str, earlier: list[str]) -> list[str]:
    """Check ``new_schema`` against earlier versions (oldest first) under a compatibility level.

    Non-transitive levels compare with the latest earlier version only.
    """
    level = level.upper()
    if level not in LEVELS:
        raise ValueError(f"unknown compatibility level {level!r}")
    if level == "NONE" or not earlier:
        return []
    targets = earlier if level.endswith("_TRANSITIVE") else earlier[-1:]
    base = level.removesuffix("_TRANSITIVE")
    messages: list[str] = []
    for old in reversed(targets):
        if base in ("BACKWARD", "FULL"):
            messages += [f"{m} (new schema cannot read data written with an earlier one)" for m in check(new_schema, old)]
        if base in ("FORWARD", "FULL"):
            messages += [f"{m} (an earlier schema cannot read data written with the new one)" for m in check(old, new_schema)]
    return messages


def _type_name(node: Schema) -> str:
    if isinstance(node, list):
        return "union"
    if isinstance(node, dict):
        kind = node["type"]
        return "record" if kind == "error" else kind
    return node


def _full_name(node: dict[str, Any]) -> str:
    return node["name"]


def _aliases(node: dict[str, Any]) -> set[str]:
    """Full names of a named type's aliases (an unqualified alias takes the type's namespace)."""
    namespace = node["name"].rpartition(".")[0]
    return {a if "." in a or not namespace else f"{namespace}.{a}" for a in node.get("aliases", [])}


class _Checker:
    """Walks reader and writer schemas together and collects incompatibilities."""

    def __init__(self, reader: _Side, writer: _Side) -> None:
        self.reader = reader
        self.writer = writer
        self.messages: list[str] = []
        self._in_progress: set[tuple[str, str]] = set()

    def run(self) -> list[str]:
        root = self.reader.resolve(self.reader.root)
        path = root["name"].rpartition(".")[2] if isinstance(root, dict) and "name" in root else ""
        self._match(self.reader.root, self.writer.root, path)
        return self.messages

    def _fail(self, path: str, rule: str, detail: str) -> None:
        self.messages.append(f"{path or '/'}: {rule}: {detail}")

    def _readable(self, reader: Schema, writer: Schema) -> bool:
        """Whether ``reader`` reads ``writer`` without recording messages (used for union branches)."""
        probe = _Checker(self.reader, self.writer)
        probe._in_progress = set(self._in_progress)
        probe._match(reader, writer, "")
        return not probe.messages

    def _match(self, reader: Schema, writer: Schema, path: str) -> None:
        reader, writer = self.reader.resolve(reader), self.writer.resolve(writer)
        r_type, w_type = _type_name(reader), _type_name(writer)

        if w_type == "union":
            for branch in writer:
                if r_type == "union" and not any(self._readable(rb, branch) for rb in reader):
                    self._fail(path, "MISSING_UNION_BRANCH", f"reader union lacks a branch for writer's {self._describe(branch)}")
                elif r_type != "union":
                    self._match(reader, branch, path)
            return
        if r_type == "union":
            if not any(self._readable(rb, writer) for rb in reader):
                self._fail(path, "MISSING_UNION_BRANCH", f"reader union lacks a branch for writer's {self._describe(writer)}")
            return

        if r_type != w_type:
            if r_type not in _PROMOTIONS.get(w_type, frozenset()):
                self._fail(path, "TYPE_MISMATCH", f"reader type {r_type} cannot read writer type {w_type}")
            return

        if r_type in ("record", "enum", "fixed"):
            if writer["name"] != reader["name"] and writer["name"] not in _aliases(reader):
                self._fail(path, "NAME_MISMATCH", f"reader name {reader['name']} does not match writer name {writer['name']}")
                return
            key = (reader["name"], writer["name"])
            if key in self._in_progress:  # recursive type already being compared
                return
            self._in_progress.add(key)
            getattr(self, f"_match_{r_type}")(reader, writer, path)
            self._in_progress.discard(key)
        elif r_type == "array":
            self._match(reader["items"], writer["items"], f"{path}[]")
        elif r_type == "map":
            self._match(reader["values"], writer["values"], f"{path}{{}}")

    def _match_record(self, reader: dict[str, Any], writer: dict[str, Any], path: str) -> None:
        writer_fields = {f["name"]: f for f in writer["fields"]}
        for r_field in reader["fields"]:
            names = [r_field["name"], *r_field.get("aliases", [])]
            w_field = next((writer_fields[n] for n in names if n in writer_fields), None)
            field_path = f"{path}.{r_field['name']}" if path else r_field["name"]
            if w_field is not None:
                self._match(r_field["type"], w_field["type"], field_path)
            elif "default" not in r_field:
                self._fail(
                    field_path,
                    "READER_FIELD_MISSING_DEFAULT_VALUE",
                    "reader field has no default value and the writer does not have it",
                )

    def _match_enum(self, reader: dict[str, Any], writer: dict[str, Any], path: str) -> None:
        missing = [s for s in writer["symbols"] if s not in reader["symbols"]]
        if missing and "default" not in reader:
            self._fail(path, "MISSING_ENUM_SYMBOLS", f"reader enum {reader['name']} lacks symbols {missing} and has no default")

    def _match_fixed(self, reader: dict[str, Any], writer: dict[str, Any], path: str) -> None:
        if reader["size"] != writer["size"]:
            self._fail(path, "FIXED_SIZE_MISMATCH", f"reader size {reader['size']} differs from writer size {writer['size']}")

    def _describe(self, node: Schema) -> str:
        node = self.writer.resolve(node)
        if isinstance(node, dict) and "name" in node:
            return f"{_type_name(node)} {node['name']}"
        return _type_name(node)
