"""The document-intake app's plugin code without the stack: codes, the generator, image checks, OCR post-processing,
extraction, the gallery, the OCR stage's degradation level, the simulator's scoring."""

from __future__ import annotations

import io
import random
from datetime import date

import numpy as np
import pytest
from PIL import Image

from intake_app.codes import id_check_char, id_number_valid, uscc_valid, uscc_with_checks
from intake_app.extraction import extract, load_spec, rows
from intake_app.gallery import NO_MATCH, Gallery
from intake_app.generator import Conditions, Generator
from intake_app.images import (BadDimensions, CorruptImage, Oversize, UnsupportedColourSpace, UnsupportedFormat,
                               check_image)
from intake_app.ocr import Line, OcrSettings, ctc_decode, rec_batches, text_boxes
from reference import INTAKE

SPEC = load_spec(INTAKE / "extraction.yaml")
CHECK = {"max_bytes": 4_000_000, "min_side": 320, "max_side": 6000, "phash_size": 16}


# -- codes ------------------------------------------------------------------------------------------
def test_identity_numbers_and_credit_codes_follow_their_standards():
    assert id_check_char("11010519491231002") == "X" and id_number_valid("11010519491231002X")
    assert not id_number_valid("110105194912310021")  # wrong check character
    assert not id_number_valid("11010519491331002X")  # no 13th month
    assert uscc_valid("91350100M000100Y43")  # GB 32100-2015's own example
    assert not uscc_valid("91350100M000100Y44") and not uscc_valid("91350100M000100I43")  # I is not in the alphabet
    assert uscc_valid(uscc_with_checks("91", "110105", "MA01BC2D"))


def test_the_generator_forges_only_what_it_says_and_is_deterministic():
    g = Generator(11, today=date(2026, 12, 1))
    docs = [g.document(i, conditions=Conditions()) for i in range(40)]
    assert [d.fields for d in docs] == [g.document(i, conditions=Conditions()).fields for i in range(40)]
    for d in docs:
        code = d.fields["id_number"] if d.doc_type == "id_card" else d.fields["uscc"]
        valid = id_number_valid(code) if d.doc_type == "id_card" else uscc_valid(code)
        assert valid != d.forged
        until = d.fields["valid_until"]
        assert (until != "长期" and date.fromisoformat(until) < date(2026, 12, 1)) == d.expired
    assert {d.expected_action for d in docs} == {"approve", "reject"}
    assert {d.doc_type for d in docs} == {"id_card", "business_licence"}


# -- image checks -----------------------------------------------------------------------------------
def _png(mode: str, size=(640, 400), color=None, fmt="PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, fmt)
    return buffer.getvalue()


def test_cmyk_rgba_grey_and_palette_scans_are_converted_to_rgb():
    for mode, fmt in (("CMYK", "JPEG"), ("RGBA", "PNG"), ("L", "PNG"), ("P", "PNG")):
        checked = check_image(_png(mode, fmt=fmt), **CHECK)
        assert checked.colour_mode == mode and checked.converted and checked.format == "png"
        assert Image.open(io.BytesIO(checked.data)).mode == "RGB"
    rgb = _png("RGB", color=(200, 10, 10), fmt="JPEG")
    checked = check_image(rgb, **CHECK)
    assert not checked.converted and checked.data == rgb and len(checked.phash) == 64 and len(checked.sha256) == 64


@pytest.mark.parametrize("data, error, message", [
    (b"%PDF-1.4 a scan", UnsupportedFormat, "not a PNG or JPEG"),
    (_png("RGB", size=(200, 120)), BadDimensions, "200x120"),
    (_png("I;16"), UnsupportedColourSpace, "colour mode I;16"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, CorruptImage, "cannot be decoded"),
    (b"\xff\xd8\xff" + b"j" * 5_000_000, Oversize, "exceeds the limit"),
])
def test_refusals_carry_their_reason_as_their_class(data, error, message):
    with pytest.raises(error, match=message):
        check_image(data, **CHECK)


# -- OCR post-processing ----------------------------------------------------------------------------
def test_ctc_decoding_drops_blanks_and_repeats_and_averages_the_kept_probabilities():
    characters = ["", "身", "份", " "]
    steps = [1, 1, 0, 2, 2, 0, 2]  # 身 身 _ 份 份 _ 份 → 身份份
    probs = np.full((1, len(steps), 4), 0.01, np.float32)
    for t, c in enumerate(steps):
        probs[0, t, c] = 0.9 if t != 3 else 0.6
    [(text, confidence)] = ctc_decode(probs, characters)
    assert text == "身份份" and confidence == pytest.approx((0.9 + 0.6 + 0.9) / 3)


def test_text_boxes_come_from_the_probability_map_in_reading_order_and_scaled_back():
    prob = np.zeros((64, 128), np.float32)
    prob[40:48, 10:60] = 0.9  # second row
    prob[8:16, 70:120] = 0.9  # first row, right
    prob[8:16, 5:40] = 0.9  # first row, left
    prob[30:31, 100:101] = 0.95  # a speck: too small
    boxes = text_boxes(prob, (128, 256), OcrSettings())
    assert len(boxes) == 3
    lefts = [float(b[:, 0].min()) for b in boxes]
    tops = [float(b[:, 1].min()) for b in boxes]
    assert lefts[0] < lefts[1] and tops[2] > tops[0]  # left to right, then the next row
    assert max(float(b[:, 0].max()) for b in boxes) > 128  # in image pixels (twice the map)


def test_text_lines_are_grouped_by_width_so_a_request_pads_little():
    crops = [np.zeros((40, w, 3), np.uint8) for w in (50, 600, 60, 590, 55)]
    batches = rec_batches(crops, OcrSettings(rec_batch=3, rec_min_width=96))
    assert [sorted(i) for i, _ in batches] == [[0, 2, 4], [1, 3]]
    assert [x.shape for _, x in batches] == [(3, 3, 48, 96), (2, 3, 48, 736)]


# -- extraction -------------------------------------------------------------------------------------
def _line(text: str, x: float, y: float, confidence: float = 0.99) -> Line:
    return Line(text, confidence, ((x, y), (x + 20 * len(text), y), (x + 20 * len(text), y + 30), (x, y + 30)))


def test_an_id_card_is_read_into_fields_and_checked():
    lines = [_line("姓名", 50, 48), _line("王芳", 140, 44), _line("性别", 50, 108), _line("女", 140, 104),
             _line("民族汉", 240, 106), _line("出生", 50, 168), _line("1990年5月1日", 140, 164),
             _line("住址", 50, 228), _line("浙江省杭州市西湖区文三路", 140, 224), _line("12号", 140, 270),
             _line("公民身份号码", 50, 400), _line("11010519491231002x", 250, 397, 0.97),
             _line("有效期限", 50, 462), _line("2016.05.01-2026.05.01", 200, 458)]
    e = extract(lines, SPEC, date(2026, 12, 1))
    assert e.doc_type == "id_card" and e.complete
    assert e.fields == {"name": "王芳", "sex": "女", "ethnicity": "汉", "birth_date": "1990-05-01",
                        "address": "浙江省杭州市西湖区文三路12号", "id_number": "11010519491231002X",
                        "valid_until": "2026-05-01"}
    assert e.code_valid and e.expired and e.code_confidence == pytest.approx(0.97) and e.min_confidence == pytest.approx(0.97)


def test_a_licence_with_a_missing_code_is_incomplete_and_noise_is_left_out():
    lines = [_line("营业执照", 360, 40), _line("名称", 60, 215), _line("杭州云帆科技有限公司", 230, 212),
             _line("福", 800, 560, confidence=0.2), _line("营业期限", 60, 587), _line("2015年03月01日至长期", 230, 584)]
    assert [r.text for r in rows(lines)] == ["营业执照", "名称杭州云帆科技有限公司", "营业期限2015年03月01日至长期"]
    e = extract(lines, SPEC, date(2026, 12, 1))
    assert e.doc_type == "business_licence" and not e.complete and "uscc" in e.missing
    assert not e.code_valid and not e.expired and e.min_confidence == 0.0 and e.fields["valid_until"] == "长期"


def test_text_of_no_known_document_is_unknown():
    e = extract([_line("发票", 10, 10)], SPEC, date(2026, 12, 1))
    assert e.doc_type == "unknown" and not e.complete


# -- the gallery ------------------------------------------------------------------------------------
class StreamOnly:
    """The two Redis stream commands the gallery uses, in memory."""

    def __init__(self):
        self.entries: list[tuple[bytes, dict[bytes, bytes]]] = []

    def xadd(self, key, fields, maxlen=None, approximate=True):
        self.entries.append((f"{len(self.entries) + 1}-0".encode(),
                             {k.encode(): v.encode() for k, v in fields.items()}))

    def xrange(self, key, min="-"):
        after = int(min[1:].split("-")[0]) if min.startswith("(") else 0
        return [e for e in self.entries if int(e[0].split(b"-")[0]) > after]


def test_the_gallery_finds_the_nearest_approved_document_and_reads_only_what_is_new():
    client = StreamOnly()
    writer, reader = Gallery(client, "g"), Gallery(client, "g")  # type: ignore[arg-type]
    assert reader.nearest("00" * 32).distance == NO_MATCH
    writer.add("doc-1", "ff" * 32, "id_card", {"name": "王芳"})
    writer.add("doc-2", "00" * 32, "business_licence", {"uscc": "91350100M000100Y43"})
    assert reader.refresh() == 2 and reader.refresh() == 0
    match = reader.nearest("0f" + "00" * 31)
    assert (match.doc_id, match.distance, match.fields) == ("doc-2", 4, {"uscc": "91350100M000100Y43"})
    writer.add("doc-3", "0f" + "00" * 31, "id_card", {})
    assert reader.refresh() == 1 and reader.nearest("0f" + "00" * 31).doc_id == "doc-3" and len(reader) == 3


def test_a_rescan_lies_near_its_document_and_far_from_other_documents():
    """What the L2 rule's threshold (12 of 256 bits) rests on, measured on the generator's cards."""
    import imagehash

    def phash(data: bytes):
        return imagehash.phash(Image.open(io.BytesIO(data)).convert("RGB"), hash_size=16)

    g = Generator(5)
    rng = random.Random(1)
    near, far = [], []
    for i in range(6):
        original = phash(g.document(i, kind="id_card", conditions=Conditions()).image)
        rescan = phash(g.document(i, kind="id_card", conditions=Conditions(noise=8, light=0.8, jpeg_quality=85)).image)
        other = phash(g.document(100 + i, kind="id_card", conditions=Conditions(blur=rng.uniform(0, 1))).image)
        near.append(original - rescan)
        far.append(original - other)
    assert max(near) <= 12 < min(far), (near, far)


# -- the OCR stage's level --------------------------------------------------------------------------
def test_the_ocr_stage_skips_the_classifier_when_its_batches_get_slow_and_the_switch_wins_both_ways():
    from streams.rules.degradation import LevelController
    from streams.rules.spec import DegradationSpec, Trigger

    clock = [0.0]
    levels = LevelController(DegradationSpec(triggers=(Trigger(signal="inference_p99_ms", above=20000, below=8000,
                                                                hold_s=60, level="L1"),)), "ocr", clock=lambda: clock[0])
    assert levels.update({"inference_p99_ms": 5000.0}) == "L0"
    assert levels.update({"inference_p99_ms": 25000.0}) == "L1"
    clock[0] = 30.0
    assert levels.update({"inference_p99_ms": 4000.0}) == "L1"  # held for 60 s before it lets go
    clock[0] = 91.0
    assert levels.update({"inference_p99_ms": 4000.0}) == "L0"
    assert levels.set_manual("L2") == "L2"  # the config center's switch


def test_the_apps_rules_make_exactly_one_decision_for_every_extraction_and_never_approve_a_bad_code():
    from itertools import product

    from streams.rules import RuleBook, RulesSettings
    from streams.topology import load_topology

    settings = RulesSettings.model_validate(load_topology(INTAKE).processors["rules"].params)
    book = RuleBook.build(settings.rules, "topology", 0, settings.topics(list(settings.actions.values())))
    for complete, code_valid, expired, min_c, code_c in product((True, False), (True, False), (True, False),
                                                                (0.0, 0.79, 0.8, 0.99), (0.0, 0.89, 0.9, 0.99)):
        context = {"complete": complete, "code_valid": code_valid, "expired": expired, "min_confidence": min_c,
                   "code_confidence": code_c}
        fired = [r.spec.action for r in book.at("L0") if r.matches(context)]
        assert len(set(fired)) == 1, (context, fired)
        if fired[0] == "approve":
            assert code_valid and complete and not expired
    for distance, action in ((0, "approve"), (12, "approve"), (13, "review"), (256, "review")):
        assert [r.spec.action for r in book.at("L2") if r.matches({"gallery_distance": distance})] == [action]
