"""The service hall: counters uploading scans of ID cards and business licences, with ground truth.

One document a tick (``rate_per_s`` ticks a second, the counters taking turns), made by
:class:`intake_app.generator.Generator`: some forged, some expired, half of them photographed badly.
Some uploads are flawed the way real ones are: CMYK, RGBA or grey scans (converted by the intake),
thumbnails (refused: ``bad_dimensions``), a PDF where an image was expected (``unsupported_format``),
the same file sent twice (``duplicate_content``). Some are re-scans of a document seen before (the
gallery's case). Records go to the raw topic in its Avro contract, large scans by reference, as the
upload gateway writes them.
"""

from __future__ import annotations

import io
import random
import time
from collections import Counter, defaultdict
from dataclasses import replace

from PIL import Image
from pydantic import Field
from rich.table import Table

from intake_app.generator import Conditions, Document, Generator
from streams.avro import topic_codec
from streams.payloads import PayloadStore
from streams.settings import StackSettings
from streams.simulation import Event, Observed, Scoreboard, Simulator, SimulatorSettings

#: Upload flaws, what the intake does with each, and the DLQ reason of a refusal.
CONVERTED = ("cmyk", "rgba", "grey")
REFUSED = {"tiny": "bad_dimensions", "not_an_image": "unsupported_format", "duplicate": "duplicate_content"}


class ServiceHall(Simulator):
    class Settings(SimulatorSettings):
        rate_per_s: float = Field(0.5, gt=0, le=50, description="Uploads per second, all counters together.")
        flawed_share: float = Field(0.1, ge=0, le=1, description="Share of uploads with a file flaw.")
        rescan_share: float = Field(0.1, ge=0, le=1, description="Share of uploads that re-scan an earlier document.")
        forged_share: float = Field(0.12, ge=0, le=1)
        expired_share: float = Field(0.12, ge=0, le=1)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        s = self.settings
        self.generator = Generator(self.seed, forged_share=s.forged_share, expired_share=s.expired_share)
        self.flawed_share = s.flawed_share
        self._truth: list[dict] = []
        self._sent: list[tuple[int, Document]] = []  # accepted uploads: (generator index, document)
        self._stack: StackSettings | None = None
        self._codec = None
        self._payloads: PayloadStore | None = None
        self._started: float | None = None

    # -- the contract ---------------------------------------------------------------------------
    def _encode(self, doc_id: str, desk: str, data: bytes, content_type: str, now_ms: int) -> bytes:
        if self._codec is None:
            self._stack = StackSettings()
            self._codec = topic_codec(self.topology, self._stack.registry_url, self.topology.simulator.source)
            self._payloads = PayloadStore.of(self.topology, self._stack)
        assert self._payloads is not None
        return self._codec.encode({"doc_id": doc_id, "device_id": desk, "uploaded_ms": now_ms,
                                   "filename": f"{doc_id}.{content_type.split('/')[-1]}",
                                   "content_type": content_type, **self._payloads.inline(data, "image")})

    def _event(self, doc: Document, desk: str, now_ms: int, data: bytes | None = None, flaw: str = "ok") -> Event:
        self._truth.append({"doc_id": doc.doc_id, "doc_type": doc.doc_type, "fields": doc.fields, "forged": doc.forged,
                            "expired": doc.expired, "expected_action": doc.expected_action,
                            "conditions": doc.conditions.describe(), "upload": flaw})
        value = self._encode(doc.doc_id, desk, data if data is not None else doc.image, doc.content_type, now_ms)
        return Event(doc.doc_id, value, doc.doc_id)

    # -- events -----------------------------------------------------------------------------------
    @property
    def rate_hz(self) -> float:
        return self.settings.rate_per_s

    def describe(self) -> str:
        s = self.settings
        return (f"{self.entities} counters uploading {s.rate_per_s:g} documents/s (ID cards and business licences; "
                f"{s.forged_share:.0%} forged, {s.expired_share:.0%} expired, {s.flawed_share:.0%} flawed files, "
                f"{s.rescan_share:.0%} re-scans)")

    def tick(self, step: int, start_ms: int) -> list[Event]:
        if self._started is None:
            self._started = time.time()
        rng = random.Random(f"{self.seed}:upload:{step}")
        desk = f"counter-{step % self.entities:02d}"
        now_ms = int(time.time() * 1000)
        index = step
        if self._sent and rng.random() < self.settings.rescan_share:
            index, earlier = rng.choice(self._sent)
            doc = self.generator.document(index, kind=earlier.doc_type, forged=earlier.forged, expired=earlier.expired,
                                          conditions=self.generator.conditions(rng))
            doc = replace(doc, doc_id=f"{doc.doc_id}-r{step}")
        else:
            doc = self.generator.document(step)
        flaw = rng.choice((*CONVERTED, *REFUSED)) if rng.random() < self.flawed_share else "ok"
        if flaw == "duplicate" and not self._sent:
            flaw = "ok"
        data = flawed(doc, flaw, self._sent[-1][1] if self._sent else None)
        if flaw == "ok" or flaw in CONVERTED:
            self._sent.append((index, doc))
        return [self._event(doc, desk, now_ms, data, flaw)]

    def truth(self, start_ms: int) -> list[tuple[str, dict]]:
        """The ground truth of the documents made so far: a document's is made with it, so the demo scores
        with what this returns after the run (the app declares no truth topic)."""
        return [(t["doc_id"], t) for t in self._truth]

    # -- scoring ----------------------------------------------------------------------------------
    def score(self, observed: Observed) -> Scoreboard:
        elapsed = time.time() - (self._started or time.time())
        decided: dict[str, dict] = {}
        for action in observed.actions:
            decided.setdefault(action["doc_id"], action)
        refused = {d.key: d.reason for d in observed.dead_letters}
        truth = {t["doc_id"]: t for t in observed.truth}
        valid = [t for t in truth.values() if t["upload"] == "ok" or t["upload"] in CONVERTED]
        flawed_ok = sum(refused.get(t["doc_id"]) == REFUSED[t["upload"]] for t in truth.values() if t["upload"] in REFUSED)
        n_refusals = sum(t["upload"] in REFUSED for t in truth.values())
        outcomes = Counter()
        fields_right: dict[tuple[str, str], list[bool]] = defaultdict(list)
        for t in valid:
            action = decided.get(t["doc_id"])
            got = action["action_type"] if action else "none"
            outcomes[(t["expected_action"], got)] += 1
            if action and action.get("model_versions"):  # read by OCR (not a gallery match, not the safe default)
                for name, value in t["fields"].items():
                    if name in ("valid_from", "company_type", "registered_capital"):
                        continue  # printed on the document, not extracted
                    fields_right[(t["doc_type"], name)].append(action["fields"].get(name) == value)
        right = sum(n for (want, got), n in outcomes.items() if want == got)
        forged_approved = sum(1 for t in valid if t["forged"] and decided.get(t["doc_id"], {}).get("action_type") == "approve")
        expired_approved = sum(1 for t in valid if t["expired"] and decided.get(t["doc_id"], {}).get("action_type") == "approve")
        table = Table(title="document intake: decisions against ground truth")
        for col in ("expected", "approve", "review", "reject", "none"):
            table.add_column(col, justify="right")
        for want in ("approve", "reject"):
            table.add_row(want, *(str(outcomes.get((want, got), 0)) for got in ("approve", "review", "reject", "none")))
        per_field = Table(title="field accuracy (documents read by OCR)")
        for col in ("document", "field", "right", "of", "accuracy"):
            per_field.add_column(col, justify="right" if col in ("right", "of", "accuracy") else "left")
        figures: dict[str, float | int] = {
            "documents": len(truth), "valid_uploads": len(valid), "decided": sum(t["doc_id"] in decided for t in valid),
            "action_accuracy": right / len(valid) if valid else float("nan"),
            "false_approvals_forged": forged_approved, "false_approvals_expired": expired_approved,
            "refusals_right": flawed_ok, "refusals_expected": n_refusals,
            "documents_per_s": sum(t["doc_id"] in decided for t in valid) / elapsed if elapsed > 0 else float("nan"),
        }
        for (doc_type, name), marks in sorted(fields_right.items()):
            accuracy = sum(marks) / len(marks)
            figures[f"field_accuracy.{doc_type}.{name}"] = accuracy
            per_field.add_row(doc_type, name, str(sum(marks)), str(len(marks)), f"{accuracy:.1%}")
        notes = [f"action accuracy {figures['action_accuracy']:.1%} over {len(valid)} valid uploads "
                 f"({figures['decided']} decided); false approvals: {forged_approved} forged, {expired_approved} expired; "
                 f"flawed files refused with the right reason: {flawed_ok}/{n_refusals}; "
                 f"{figures['documents_per_s']:.2f} documents/s decided (first upload to the end of the drain)"]
        return Scoreboard(tables=[table, per_field], figures=figures, notes=notes)

    # -- verify -----------------------------------------------------------------------------------
    def probe(self, now_ms: int) -> tuple[Event, Event, str]:
        doc = self.generator.document(now_ms % 1_000_000, kind="id_card", forged=False, expired=False, conditions=Conditions())
        doc = replace(doc, doc_id=f"probe-{now_ms}")
        bad = replace(doc, doc_id=f"probe-{now_ms}-bad")
        return (self._event(doc, "counter-probe", now_ms),
                self._event(bad, "counter-probe", now_ms, flawed(bad, "not_an_image", None), "not_an_image"),
                REFUSED["not_an_image"])

    def incident(self, start_ms: int) -> tuple[list[list[Event]], str]:
        doc = self.generator.document(start_ms % 1_000_000 + 1, kind="id_card", forged=True, expired=False,
                                      conditions=Conditions())
        doc = replace(doc, doc_id=f"incident-{start_ms}")
        return [[self._event(doc, "counter-probe", start_ms)]], doc.doc_id

    def load(self, entities: int) -> Simulator:
        return ServiceHall(self.topology, self.settings.model_copy(update={"flawed_share": 0.0}),
                           entities=entities, seed=self.seed + 1)


def flawed(doc: Document, flaw: str, earlier: Document | None) -> bytes:
    """The file a flawed upload sends (the document's own for ``ok``)."""
    if flaw == "ok":
        return doc.image
    if flaw == "duplicate":
        assert earlier is not None
        return earlier.image
    if flaw == "not_an_image":
        return b"%PDF-1.4\n% a scan saved as PDF\n" + doc.image[:2048]
    image = Image.open(io.BytesIO(doc.image)).convert("RGB")
    buffer = io.BytesIO()
    if flaw == "cmyk":
        image.convert("CMYK").save(buffer, "JPEG", quality=90)
    elif flaw == "rgba":
        image.putalpha(255)
        image.save(buffer, "PNG", compress_level=1)
    elif flaw == "grey":
        image.convert("L").save(buffer, "PNG", compress_level=1)
    elif flaw == "tiny":
        image.resize((image.width // 5, image.height // 5)).save(buffer, "PNG")
    else:
        raise ValueError(f"unknown upload flaw {flaw!r}")
    return buffer.getvalue()
