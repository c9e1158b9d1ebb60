"""HTTP ingest on the real broker and registry: the answers, and what lands on Kafka.

Every caller shows an API key made in the test's own config-center topic: its identity is who the
rate limits and the dead-letter budget charge.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import aiohttp
import pytest
from aiohttp import web

from streams.avro import codec
from streams.config_center import ConfigCenter
from streams.gateway.http import HttpGatewaySettings, build_app
from streams.security import keys
from streams.ingest import REJECTED
from reference import load_schema

from gateway_helpers import free_port, headers, ingest_topology, read_topic

pytestmark = pytest.mark.integration

SUBJECT = "pm.ingest.telemetry-value"


def reading(device: str = "dev-h", **over) -> dict:
    return {"event_id": uuid.uuid4().hex, "device_id": device, "ts": int(time.time() * 1000), "temperature": 60.0,
            "vibration": 2.0, "current": 12.0, "pressure": 5.0, "rpm": 1500.0, **over}


async def serve_and_call(topology, stack, calls, config_topic: str):
    """Start the gateway on a free port, run ``calls(session, url)``, stop it."""
    settings = HttpGatewaySettings(port=free_port(), max_body_bytes=64 * 1024, max_batch=200, config_topic=config_topic)
    runner = web.AppRunner(build_app(topology, None, stack, settings))
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.port).start()
    try:
        async with aiohttp.ClientSession() as session:
            return await calls(session, f"http://{settings.host}:{settings.port}/v1/streams/telemetry/events")
    finally:
        await runner.cleanup()


def test_http_status_codes_and_what_lands_on_kafka(stack, tmp_path):
    topology, prefix = ingest_topology(
        tmp_path, stack, gateway_params={"rate_limits": {"per_client": {"rate_per_s": 5, "burst": 120}}})
    single, batch = reading(), [reading(f"dev-{i % 3}") for i in range(100)]
    bad_batch = [reading(), reading(temperature="hot"), reading(vibration=1e6)]
    config_topic = f"_tangram.config.{prefix}"
    center = ConfigCenter(stack.kafka, config_topic)
    key = {who: {"Authorization": f"Bearer {keys.create(center, who, prefix, ['telemetry']).token}"} for who in "abcdef"}
    key["g"] = {"Authorization": f"Bearer {keys.create(center, 'g', prefix, ['telemetry'], dlq_per_hour=1).token}"}

    async def calls(session: aiohttp.ClientSession, url: str) -> dict:
        answers = {}

        async def post(name, data=None, json_body=None, **kw):
            async with session.post(url, data=data, json=json_body, **kw) as r:
                answers[name] = (r.status, await r.json(), dict(r.headers))

        await post("no key", json_body=single)
        await post("single", json_body=single, headers=key["a"])
        await post("batch", json_body=batch, headers=key["b"])
        await post("duplicate", json_body=single, headers=key["c"])
        await post("invalid", json_body=bad_batch, headers=key["d"])
        await post("not json", data=b'{"event_id": ', headers={"Content-Type": "application/json", **key["d"]})
        await post("over budget", json_body=bad_batch, headers=key["g"])
        await post("text", data=b"hello", headers={"Content-Type": "text/plain", **key["a"]})
        await post("too large", data=b"[" + b"1," * 40_000 + b"1]", headers={"Content-Type": "application/json", **key["a"]})
        await post("too many", json_body=[reading() for _ in range(201)], headers=key["a"])
        await post("flood 1", json_body=[reading() for _ in range(100)], headers=key["e"])
        await post("flood 2", json_body=[reading() for _ in range(100)], headers=key["e"])
        await post("over burst", json_body=[reading() for _ in range(150)], headers=key["f"])
        async with session.post(url.replace("telemetry", "nope"), json=single, headers=key["a"]) as r:
            answers["unknown"] = (r.status, await r.json(), {})
        return answers

    throttled_before = REJECTED.labels("telemetry", "rate_limited")._value.get()
    answers = asyncio.run(serve_and_call(topology, stack, calls, config_topic))

    assert answers["no key"][0] == 401 and "WWW-Authenticate" in answers["no key"][2]
    assert answers["single"][:2] == (200, {"accepted": 1, "duplicates": 0})
    assert answers["batch"][:2] == (200, {"accepted": 100, "duplicates": 0})
    assert answers["duplicate"][:2] == (200, {"accepted": 0, "duplicates": 1})
    status, body, _ = answers["invalid"]
    assert status == 400 and body["accepted"] == 0
    assert [(e["index"], e["path"], e["reason"]) for e in body["errors"]] == [
        (1, "$[1].temperature", "schema"), (2, "$[2].vibration", "out_of_range")]
    assert answers["not json"][0] == 400 and answers["not json"][1]["error"] == "bad_json"
    status, body, hdrs = answers["over budget"]  # 2 dead letters, a budget of 1: answered, not written
    assert status == 429 and body["error"] == "dlq_budget" and len(body["errors"]) == 2 and "Retry-After" in hdrs
    assert answers["text"][0] == 415
    assert answers["too large"][0] == 413 and answers["too many"][0] == 413
    assert answers["flood 1"][:2] == (200, {"accepted": 100, "duplicates": 0})
    status, body, hdrs = answers["flood 2"]
    assert status == 429 and body["error"] == "rate_limited" and int(hdrs["Retry-After"]) >= 1
    assert answers["over burst"][0] == 413 and "smaller batches" in answers["over burst"][1]["message"]
    assert answers["unknown"][0] == 404
    assert REJECTED.labels("telemetry", "rate_limited")._value.get() - throttled_before == 100 + 150  # counted per reading

    contract = codec(stack.registry_url, SUBJECT, load_schema(SUBJECT))
    ingested = read_topic(stack, f"{prefix}.ingest.telemetry", at_least=201)
    ids = [contract.decode(m.value())["event_id"] for m in ingested]
    assert len(ids) == 201 and len(set(ids)) == 201  # single + batch + flood 1, each once
    assert ids[:101] == [single["event_id"]] + [r["event_id"] for r in batch]  # in request order
    assert {m.key() for m in ingested[1:4]} == {b"dev-0", b"dev-1", b"dev-2"}  # keyed by device
    dead = read_topic(stack, f"{prefix}.dlq.ingest", at_least=3)
    assert sorted(headers(m)["dlq.reason"] for m in dead) == ["bad_json", "out_of_range", "schema"]
    schema_dlq = next(m for m in dead if headers(m)["dlq.reason"] == "schema")
    assert json.loads(schema_dlq.value())["temperature"] == "hot"
    h = headers(schema_dlq)
    assert h["dlq.source_topic"] == "http:telemetry" and h["dlq.field"] == "temperature" and h["client_id"] == "d"
