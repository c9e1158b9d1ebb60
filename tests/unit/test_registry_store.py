"""Schema registry state and Avro compatibility rules, without Kafka."""

from __future__ import annotations

import json
from typing import Any

import pytest

from streams.registry.compatibility import check, check_level
from streams.registry.store import RegistryError, SchemaRegistryState
from streams.statelog import LogRecord


def record(fields: list[dict[str, Any]], name: str = "Reading", **extra: Any) -> str:
    return json.dumps({"type": "record", "name": name, "namespace": "pm", "fields": fields, **extra})


V1 = record([{"name": "device", "type": "string"}, {"name": "temp", "type": "int"}])


def commit(state: SchemaRegistryState, change: tuple[Any, list[LogRecord]]) -> Any:
    """Apply a change's records as the service does after the log acknowledged them."""
    result, records = change
    for rec in records:
        state.apply(LogRecord.from_bytes(rec.key_bytes(), rec.value_bytes()))  # through the wire form
    return result


def replayed(state: SchemaRegistryState, log: list[LogRecord]) -> SchemaRegistryState:
    fresh = SchemaRegistryState()
    for rec in log:
        fresh.apply(rec)
    return fresh


# ---- compatibility -----------------------------------------------------------------------


def test_field_added_with_default_is_backward_compatible() -> None:
    v2 = record([{"name": "device", "type": "string"}, {"name": "temp", "type": "int"},
                 {"name": "rpm", "type": "double", "default": 0.0}])
    assert check(v2, V1) == []
    assert check(V1, v2) == []  # old reader skips the writer's new field


def test_field_added_without_default_names_field_and_rule() -> None:
    v2 = record([{"name": "device", "type": "string"}, {"name": "temp", "type": "int"},
                 {"name": "rpm", "type": "double"}])
    [message] = check(v2, V1)
    assert message.startswith("Reading.rpm: READER_FIELD_MISSING_DEFAULT_VALUE")


def test_field_removed_breaks_forward_only_without_default() -> None:
    v2 = record([{"name": "device", "type": "string"}])
    assert check(v2, V1) == []
    assert "Reading.temp: READER_FIELD_MISSING_DEFAULT_VALUE" in check(V1, v2)[0]


@pytest.mark.parametrize(
    ("writer", "reader", "ok"),
    [
        ("int", "long", True), ("int", "float", True), ("int", "double", True),
        ("long", "float", True), ("long", "double", True), ("float", "double", True),
        ("string", "bytes", True), ("bytes", "string", True),
        ("long", "int", False), ("double", "float", False), ("string", "int", False),
        ("boolean", "int", False),
    ],
)
def test_primitive_promotions(writer: str, reader: str, ok: bool) -> None:
    messages = check(record([{"name": "x", "type": reader}]), record([{"name": "x", "type": writer}]))
    assert (messages == []) is ok
    if not ok:
        assert messages[0].startswith("Reading.x: TYPE_MISMATCH")


def enum(symbols: list[str], **extra: Any) -> str:
    return record([{"name": "state", "type": {"type": "enum", "name": "State", "symbols": symbols, **extra}}])


def test_enum_symbols() -> None:
    assert check(enum(["A", "B", "C"]), enum(["A", "B"])) == []
    [message] = check(enum(["A"]), enum(["A", "B"]))
    assert message.startswith("Reading.state: MISSING_ENUM_SYMBOLS") and "'B'" in message
    assert check(enum(["A", "UNKNOWN"], default="UNKNOWN"), enum(["A", "B"])) == []


def test_unions() -> None:
    nullable = record([{"name": "x", "type": ["null", "int"], "default": None}])
    plain = record([{"name": "x", "type": "int"}])
    assert check(nullable, plain) == []  # reader union has an int branch
    assert "Reading.x: TYPE_MISMATCH: reader type int cannot read writer type null" in check(plain, nullable)
    wider = record([{"name": "x", "type": ["null", "long", "string"], "default": None}])
    assert check(wider, nullable) == []  # int → long promotion inside a union
    assert "MISSING_UNION_BRANCH" in check(nullable, wider)[0]


def test_nested_records_arrays_maps() -> None:
    def nested(inner_type: str) -> str:
        inner = {"type": "record", "name": "Point", "fields": [{"name": "v", "type": inner_type}]}
        return record([
            {"name": "points", "type": {"type": "array", "items": inner}},
            {"name": "tags", "type": {"type": "map", "values": inner_type}},
        ])

    assert check(nested("double"), nested("float")) == []
    messages = check(nested("int"), nested("string"))
    assert any(m.startswith("Reading.points[].v: TYPE_MISMATCH") for m in messages)
    assert any(m.startswith("Reading.tags{}: TYPE_MISMATCH") for m in messages)


def test_names_and_aliases() -> None:
    old = record([{"name": "temp", "type": "int"}], name="OldReading")
    renamed = record([{"name": "temperature", "type": "int", "aliases": ["temp"]}], aliases=["OldReading"])
    assert check(renamed, old) == []
    assert "NAME_MISMATCH" in check(record([{"name": "temp", "type": "int"}]), old)[0]


def test_fixed_size_and_recursive_types() -> None:
    def fixed(size: int) -> str:
        return record([{"name": "h", "type": {"type": "fixed", "name": "Hash", "size": size}}])

    assert check(fixed(16), fixed(16)) == []
    assert "FIXED_SIZE_MISMATCH" in check(fixed(16), fixed(32))[0]
    node = json.dumps({"type": "record", "name": "Node", "fields": [
        {"name": "v", "type": "int"}, {"name": "next", "type": ["null", "Node"], "default": None}]})
    assert check(node, node) == []


def test_levels() -> None:
    v2 = record([{"name": "device", "type": "string"}, {"name": "temp", "type": "int"},
                 {"name": "rpm", "type": "double", "default": 0.0}])
    v3 = record([{"name": "device", "type": "string"}, {"name": "rpm", "type": "double", "default": 0.0}])
    # v3 drops temp (no default in v1): BACKWARD ok, FORWARD against v1 not
    assert check_level("BACKWARD", v3, [V1, v2]) == []
    assert check_level("FORWARD", v3, [V1, v2]) != []  # v2 reader needs temp, which has no default
    assert check_level("NONE", v3, [V1, v2]) == []
    v4 = record([{"name": "device", "type": "string"}, {"name": "temp", "type": "int", "default": 0},
                 {"name": "rpm", "type": "double"}])
    # v4 needs rpm without default: latest (v2) wrote rpm, v1 did not
    assert check_level("BACKWARD", v4, [V1, v2]) == []
    assert check_level("BACKWARD_TRANSITIVE", v4, [V1, v2]) != []
    assert check_level("FULL", v2, [V1]) == []


# ---- state --------------------------------------------------------------------------------


def test_register_versions_ids_and_replay() -> None:
    state, log = SchemaRegistryState(), []

    def do(change: tuple[Any, list[LogRecord]]) -> Any:
        log.extend(change[1])
        return commit(state, change)

    a1 = do(state.register("a-value", V1))
    assert (a1.id, a1.version) == (1, 1)
    same = do(state.register("a-value", json.dumps(json.loads(V1), indent=2)))  # whitespace differs
    assert (same.id, same.version) == (1, 1) and len(log) == 1
    b1 = do(state.register("b-value", V1))  # same schema, other subject: same global id
    assert (b1.id, b1.version) == (1, 1)
    v2 = record([{"name": "device", "type": "string"}, {"name": "temp", "type": "long"}])
    a2 = do(state.register("a-value", v2))
    assert (a2.id, a2.version) == (2, 2)
    assert state.lookup("a-value", V1).version == 1
    assert state.get_version("a-value", "latest").id == 2
    assert [(sv.subject, sv.version) for sv in state.versions_of_id(1)] == [("a-value", 1), ("b-value", 1)]
    assert replayed(state, log) == state


def test_incompatible_registration_is_409_with_messages() -> None:
    state = SchemaRegistryState()
    commit(state, state.register("s", V1))
    bad = record([{"name": "device", "type": "int"}, {"name": "temp", "type": "int"}])
    with pytest.raises(RegistryError) as info:
        state.register("s", bad)
    assert (info.value.status, info.value.error_code) == (409, 409)
    assert "Reading.device: TYPE_MISMATCH" in info.value.message
    commit(state, state.set_level("s", "none"))
    assert state.level("s") == "NONE" and state.level() == "BACKWARD"
    assert commit(state, state.register("s", bad)).version == 2


def test_errors_have_confluent_codes() -> None:
    state = SchemaRegistryState()
    cases = [
        (lambda: state.versions("nope"), 40401),
        (lambda: state.register("s", "{not json"), 42201),
        (lambda: state.register("s", '{"type": "record", "name": "X"}'), 42201),
        (lambda: state.set_level(None, "SIDEWAYS"), 42203),
        (lambda: state.schema_by_id(99), 40403),
    ]
    for call, code in cases:
        with pytest.raises(RegistryError) as info:
            call()
        assert info.value.error_code == code
    commit(state, state.register("s", V1))
    for version, code in [("7", 40402), ("zero", 42202), ("0", 42202)]:
        with pytest.raises(RegistryError) as info:
            state.get_version("s", version)
        assert info.value.error_code == code
    with pytest.raises(RegistryError) as info:
        state.lookup("s", record([{"name": "other", "type": "int"}]))
    assert info.value.error_code == 40403


def test_soft_then_hard_delete_and_id_not_reused() -> None:
    state, log = SchemaRegistryState(), []

    def do(change: tuple[Any, list[LogRecord]]) -> Any:
        log.extend(change[1])
        return commit(state, change)

    do(state.register("s", V1))
    v2 = record([{"name": "device", "type": "string"}, {"name": "temp", "type": "long"}])
    do(state.register("s", v2))
    with pytest.raises(RegistryError) as info:
        state.delete_version("s", 2, permanent=True)
    assert info.value.error_code == 40407
    assert do(state.delete_version("s", "latest", permanent=False)) == 2
    assert [sv.version for sv in state.versions("s")] == [1]
    assert json.loads(state.schema_by_id(2)) == json.loads(v2)  # a soft-deleted version's id still resolves
    assert do(state.delete_subject("s", permanent=False)) == [1]
    assert state.subject_names() == [] and state.subject_names(deleted=True) == ["s"]
    with pytest.raises(RegistryError) as info:
        state.delete_subject("s", permanent=False)
    assert info.value.error_code == 40404
    assert do(state.delete_subject("s", permanent=True)) == [1, 2]
    assert state.subject_names(deleted=True) == []
    with pytest.raises(RegistryError):
        state.schema_by_id(1)
    # compaction keeps only the last record per key: tombstones and the id floor survive
    compacted = list({rec.key_bytes(): rec for rec in log}.values())
    fresh = replayed(state, [rec for rec in compacted if rec.value is not None])
    assert fresh.max_id == 2
    assert commit(fresh, fresh.register("t", record([{"name": "z", "type": "int"}]))).id == 3


def test_config_records() -> None:
    state = SchemaRegistryState()
    assert commit(state, state.set_level(None, "full_transitive")) == "FULL_TRANSITIVE"
    assert state.level("anything") == "FULL_TRANSITIVE"
    commit(state, state.register("s", V1))
    commit(state, state.set_level("s", "NONE"))
    assert commit(state, state.delete_level("s")) == "NONE"
    assert state.level("s") == "FULL_TRANSITIVE"
    assert commit(state, state.delete_level(None)) == "FULL_TRANSITIVE"
    assert state.level() == "BACKWARD"
    with pytest.raises(RegistryError) as info:
        state.delete_level("unknown")
    assert info.value.error_code == 40401


def test_primitive_schemas() -> None:
    state = SchemaRegistryState()
    sv = commit(state, state.register("key", '"string"'))
    assert sv.schema == '"string"'
    assert check('"bytes"', '"string"') == [] and check('"int"', '"long"') != []


# ---- HTTP layer, in process, without Kafka ---------------------------------------------------


def test_http_api_without_kafka() -> None:
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from streams.registry.app import CONTENT_TYPE, Registry, create_app

    async def scenario() -> None:
        async with TestClient(TestServer(create_app(Registry(None)))) as http:
            headers = {"Content-Type": CONTENT_TYPE}
            resp = await http.post("/subjects/a%2Fb/versions", data=json.dumps({"schema": V1}), headers=headers)
            assert resp.status == 200 and resp.content_type == CONTENT_TYPE
            assert (await resp.json(content_type=None))["id"] == 1
            resp = await http.get("/subjects")
            assert await resp.json(content_type=None) == ["a/b"]
            resp = await http.get("/subjects/a%2Fb/versions/latest/schema")
            assert (await resp.json(content_type=None))["name"] == "Reading"
            resp = await http.get("/subjects/nope/versions")
            assert resp.status == 404
            assert await resp.json(content_type=None) == {"error_code": 40401, "message": "Subject 'nope' not found."}
            resp = await http.post("/subjects/x/versions", data=json.dumps({"schema": '"int"', "schemaType": "JSON"}))
            assert (resp.status, (await resp.json(content_type=None))["error_code"]) == (422, 42201)
            resp = await http.put("/config", data=json.dumps({"compatibility": "full"}))
            assert await resp.json(content_type=None) == {"compatibility": "FULL"}
            resp = await http.get("/config")
            assert await resp.json(content_type=None) == {"compatibilityLevel": "FULL"}

    asyncio.run(scenario())
