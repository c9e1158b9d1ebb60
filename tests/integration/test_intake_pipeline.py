"""The document-intake app on the real stack: PP-OCR on Triton, uploads over HTTP and Kafka, decisions, degradation.

A handful of documents (OCR takes seconds a document on these CPUs): a valid card uploaded with the seeds'
curl-style multipart request, a forged card, an expired licence and a CMYK scan straight to Kafka, a PDF and
a duplicate that the intake refuses; then the config center's switch to L2 (a re-scan matched in the gallery,
an unknown document to a person) and to L3 (everything to a person), without a restart.
"""

from __future__ import annotations

import asyncio
import io
import time
import uuid
from dataclasses import replace

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from PIL import Image

from intake_app.generator import Conditions, Document, Generator
from reference import INTAKE
from streams.config_center import ConfigCenter
from streams.security import keys
from streams.gateway.upload import UploadGatewaySettings, build_app
from streams.lifecycle.repository import build_models, install_models, model_dirs
from streams.payloads import PayloadStore
from streams.testing import AppHarness
from streams.topology import load_topology

pytestmark = pytest.mark.integration

ACTIONS = ("intake.actions.approve", "intake.actions.review", "intake.actions.reject")


@pytest.fixture(scope="module")
def ocr_models(stack):
    """The app's models built (copied from the installed wheel) and installed into the test stack's Triton."""
    topology = load_topology(INTAKE)
    print(build_models(topology))
    install_models(topology, stack, [m.name for m in model_dirs(topology.model_repository)])
    return stack


def _app_copy(tmp_path, prefix: str):
    """The app's topology with its own config topic and Redis keys, so switches and the gallery touch no other test."""
    doc = yaml.safe_load((INTAKE / "topology.yaml").read_text())
    doc["root"] = str(INTAKE)
    config_topic = f"_tangram.config.{prefix}"
    for name in ("ocr", "rules"):
        doc["processors"][name]["params"]["config_topic"] = config_topic
    for name in ("intake", "gallery"):
        doc["processors"][name].setdefault("params", {})["key_prefix"] = prefix
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return path, config_topic


def _upload(app: AppHarness, stack, doc: Document, desk: str, key: str, config_topic: str) -> dict:
    """The seeds' `curl -F image=@card.png -H "X-Device-ID: ..."` against the upload gateway on the harness's
    topics, with the desk's API key."""
    settings = UploadGatewaySettings(config_topic=config_topic)

    async def run() -> dict:
        async with TestClient(TestServer(build_app(app.topology, stack, settings))) as client:
            form = aiohttp.FormData()
            form.add_field("image", doc.image, filename=f"{doc.doc_id}.png", content_type=doc.content_type)
            response = await client.post("/v1/uploads/documents", data=form,
                                         headers={"X-Device-ID": desk, "X-Request-ID": doc.doc_id,
                                                  "Authorization": f"Bearer {key}"})
            assert response.status == 202, await response.text()
            return await response.json()

    return asyncio.run(run())


def _send(app: AppHarness, stack, doc: Document, data: bytes | None = None) -> None:
    """A producer writing straight to the raw topic, in its contract (a large file by reference)."""
    store = PayloadStore.of(app.topology, stack)
    record = {"doc_id": doc.doc_id, "device_id": "counter-kafka", "uploaded_ms": int(time.time() * 1000),
              "filename": "", "content_type": doc.content_type, **store.inline(data or doc.image, "image")}
    app.send("intake.raw.documents", [record], key="doc_id", id_field="doc_id")


def _decisions(app: AppHarness, doc_ids: set[str], timeout_s: float) -> dict[str, dict]:
    """The first decision on each of ``doc_ids``, waiting until every one has one."""
    found: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while set(found) < doc_ids and time.monotonic() < deadline:
        for topic in ACTIONS:
            for action in app.read(topic, idle_s=1.0, timeout_s=5.0):
                found.setdefault(action["doc_id"], action)
    return {d: found[d] for d in doc_ids if d in found}


def _switch(app: AppHarness, stack, center: ConfigCenter, level: str, rules: set[str], g: Generator, prefix: str) -> None:
    """Set the level, then send fresh documents until one is decided by a rule of that level (every processor
    follows the config center within a micro-batch or two; this waits for that, not for a fixed time)."""
    center.set("feature-switch", "degradation.level", level, reason=f"test: {level}")
    for attempt in range(6):
        canary = replace(g.document(900 + attempt, kind="id_card", conditions=Conditions()), doc_id=f"{prefix}-{level}-{attempt}")
        _send(app, stack, canary)
        decision = _decisions(app, {canary.doc_id}, timeout_s=60).get(canary.doc_id)
        if decision is not None and decision["rule"] in rules:
            return
    raise AssertionError(f"the processors did not follow the switch to {level}")


def _cmyk(doc: Document) -> bytes:
    buffer = io.BytesIO()
    Image.open(io.BytesIO(doc.image)).convert("CMYK").save(buffer, "JPEG", quality=92)
    return buffer.getvalue()


def test_documents_are_read_checked_decided_and_degraded_live(ocr_models, tmp_path):
    stack = ocr_models
    prefix = f"t{uuid.uuid4().hex[:8]}"
    path, config_topic = _app_copy(tmp_path, prefix)
    g = Generator(2026)
    clean = Conditions()
    card = replace(g.document(1, kind="id_card", forged=False, expired=False, conditions=clean), doc_id=f"{prefix}-card")
    forged = replace(g.document(2, kind="id_card", forged=True, expired=False, conditions=clean), doc_id=f"{prefix}-forged")
    expired = replace(g.document(3, kind="business_licence", forged=False, expired=True, conditions=clean),
                      doc_id=f"{prefix}-expired")
    cmyk = replace(g.document(4, kind="business_licence", forged=False, expired=False, conditions=clean),
                   doc_id=f"{prefix}-cmyk")
    with AppHarness(path, stack, prefix=prefix) as app:
        desk = keys.create(ConfigCenter(stack.kafka, config_topic), "counter-07", prefix, ["documents"]).token
        answer = _upload(app, stack, card, "counter-07", desk, config_topic)
        assert answer["id"] == card.doc_id and answer["stored"] in ("inline", "reference")
        _upload(app, stack, forged, "counter-07", desk, config_topic)
        _send(app, stack, expired)
        _send(app, stack, cmyk, _cmyk(cmyk))
        _send(app, stack, replace(card, doc_id=f"{prefix}-pdf"), b"%PDF-1.4 a scan saved as PDF")
        _send(app, stack, replace(card, doc_id=f"{prefix}-again"))  # the card's very bytes, a second time

        decided = _decisions(app, {card.doc_id, forged.doc_id, expired.doc_id, cmyk.doc_id}, timeout_s=240)
        refused = {m.key().decode(): dict(m.headers())["dlq.reason"].decode()
                   for m in app.read("intake.dlq.intake", count=2, idle_s=3.0)}
        assert refused == {f"{prefix}-pdf": "unsupported_format", f"{prefix}-again": "duplicate_content"}
        assert {d: a["action_type"] for d, a in decided.items()} == {
            card.doc_id: "approve", forged.doc_id: "reject", expired.doc_id: "reject", cmyk.doc_id: "approve"}
        approved = decided[card.doc_id]
        # explainable: the rule and what it read, the fields and confidences, the models that read it
        assert approved["rule"] == "valid" and approved["fields"]["id_number"] == card.fields["id_number"]
        assert {k: approved["fields"].get(k) for k in card.fields if k != "valid_from"} == \
            {k: v for k, v in card.fields.items() if k != "valid_from"}
        assert min(approved["confidences"].values()) >= 0.8 and approved["device_id"] == "counter-07"
        assert set(approved["model_versions"]) == {"ppocr_det", "ppocr_rec", "ppocr_cls"}
        assert "min_confidence=" in approved["reason"] and approved["degradation_level"] == "L0"
        assert decided[forged.doc_id]["rule"] == "forged_code" and decided[expired.doc_id]["rule"] == "expired"
        assert decided[cmyk.doc_id]["fields"]["uscc"] == cmyk.fields["uscc"]

        # L2 from the config center, no restart: OCR stops, a re-scan of the approved card is matched in the
        # gallery, a document never seen goes to a person
        center = ConfigCenter(stack.kafka, config_topic)
        _switch(app, stack, center, "L2", {"gallery_match", "no_gallery_match"}, g, prefix)
        rescan = replace(g.document(1, kind="id_card", forged=False, expired=False,
                                    conditions=Conditions(noise=6, light=0.85, jpeg_quality=90)), doc_id=f"{prefix}-rescan")
        unseen = replace(g.document(5, kind="id_card", forged=False, expired=False, conditions=clean),
                         doc_id=f"{prefix}-unseen")
        _send(app, stack, rescan)
        _send(app, stack, unseen)
        at_l2 = _decisions(app, {rescan.doc_id, unseen.doc_id}, timeout_s=60)
        assert {d: (a["rule"], a["degradation_level"]) for d, a in at_l2.items()} == {
            rescan.doc_id: ("gallery_match", "L2"), unseen.doc_id: ("no_gallery_match", "L2")}
        assert at_l2[rescan.doc_id]["gallery_doc_id"] == card.doc_id and at_l2[rescan.doc_id]["gallery_distance"] <= 12
        assert at_l2[rescan.doc_id]["fields"]["id_number"] == card.fields["id_number"]  # the fields approved before
        assert at_l2[rescan.doc_id]["model_versions"] == {}  # no model read it

        _switch(app, stack, center, "L3", {"safe_default"}, g, prefix)
        late = replace(g.document(6, kind="id_card", forged=False, expired=False, conditions=clean), doc_id=f"{prefix}-l3")
        _send(app, stack, late)
        [at_l3] = _decisions(app, {late.doc_id}, timeout_s=60).values()
        assert (at_l3["action_type"], at_l3["rule"], at_l3["degradation_level"]) == ("review", "safe_default", "L3")
