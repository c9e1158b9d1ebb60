"""Field extraction: OCR lines → fields by a declared spec (``extraction.yaml``) → the checks rules decide on.

The spec is data (regular expressions and position hints per document type), validated here by frozen
pydantic models, so changing what is read means editing the spec, not the stage. The checks:
``complete`` (every required field found), ``code_valid`` (the identity number or credit code passes
its standard's check characters, :mod:`intake_app.codes`), ``expired`` (the validity period ended
before the upload day), and the confidences: per field the lowest of the lines it was read from,
``min_confidence`` over the required fields, ``code_confidence`` of the code alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from intake_app.codes import id_number_valid, uscc_valid
from intake_app.ocr import Line
from streams.yamlfile import load_model

CHECKS = {"id_number": id_number_valid, "uscc": uscc_valid}
_DATE = re.compile(r"^(\d{4})(?:年|\.)(\d{1,2})(?:月|\.)(\d{1,2})日?$")
LONG_TERM = "长期"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FieldSpec(_Frozen):
    pattern: str = Field(description="A regular expression with a named group `value`, matched on a row's text.")
    kind: Literal["text", "date"] = "text"
    normalise: Literal["none", "upper"] = "none"
    continues: int = Field(0, ge=0, le=5, description="Following rows that may continue the value.")
    required: bool = True

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        if "value" not in re.compile(pattern).groupindex:
            raise ValueError(f"pattern {pattern!r} has no named group `value`")
        return pattern

    @cached_property
    def regex(self) -> re.Pattern[str]:
        return re.compile(self.pattern)


class CodeSpec(_Frozen):
    field: str
    check: Literal["id_number", "uscc"]


class DocumentSpec(_Frozen):
    detect: tuple[str, ...] = Field(min_length=1, description="Words that identify the type in the text.")
    code: CodeSpec
    expiry: str
    fields: dict[str, FieldSpec] = Field(min_length=1)


class ExtractionSpec(_Frozen):
    documents: dict[str, DocumentSpec] = Field(min_length=1)


def load_spec(path: Path) -> ExtractionSpec:
    return load_model(path, ExtractionSpec, "extraction spec")


@dataclass(frozen=True)
class Row:
    text: str
    confidence: float


@dataclass(frozen=True)
class Extraction:
    doc_type: str
    fields: dict[str, str]
    confidences: dict[str, float]
    missing: list[str]
    code_valid: bool
    expired: bool
    min_confidence: float
    code_confidence: float

    @property
    def complete(self) -> bool:
        return not self.missing


#: Lines read with less confidence are noise (a seal, a pattern), as PP-OCR's own pipeline drops them.
MIN_LINE_CONFIDENCE = 0.5


def rows(lines: list[Line]) -> list[Row]:
    """Lines grouped into rows, left to right, top to bottom: a line joins a row when its vertical centre lies
    within the band of the row's last line (so a tilted row stays one). A row's text has no spaces and its
    confidence is its lowest line's; lines under ``MIN_LINE_CONFIDENCE`` are left out."""
    bands: list[tuple[float, float, list[Line]]] = []
    for line in sorted((l for l in lines if l.confidence >= MIN_LINE_CONFIDENCE), key=lambda l: (l.top + l.bottom) / 2):
        centre = (line.top + line.bottom) / 2
        if bands and bands[-1][0] <= centre <= bands[-1][1]:
            bands[-1] = (line.top, line.bottom, [*bands[-1][2], line])
        else:
            bands.append((line.top, line.bottom, [line]))
    out = []
    for _, _, members in bands:
        members = [m for m in sorted(members, key=lambda l: l.left) if m.text.strip()]
        if members:
            out.append(Row("".join("".join(m.text.split()) for m in members), min(m.confidence for m in members)))
    return out


def parse_date(text: str) -> str:
    """2026年3月7日 or 2026.03.07 → 2026-03-07; 长期 stays; anything else is returned as read."""
    if text == LONG_TERM:
        return text
    match = _DATE.match(text)
    if not match:
        return text
    try:
        return date(int(match[1]), int(match[2]), int(match[3])).isoformat()
    except ValueError:
        return text


def extract(lines: list[Line], spec: ExtractionSpec, today: date) -> Extraction:
    """The fields and checks of one document's lines."""
    text_rows = rows(lines)
    whole = "".join(r.text for r in text_rows)
    doc_type = next((name for name, d in spec.documents.items() if any(w in whole for w in d.detect)), None)
    if doc_type is None:
        return Extraction("unknown", {}, {}, ["doc_type"], False, False, 0.0, 0.0)
    document = spec.documents[doc_type]
    fields: dict[str, str] = {}
    confidences: dict[str, float] = {}
    for name, field in document.fields.items():
        for i, row in enumerate(text_rows):
            match = field.regex.search(row.text)
            if match is None:
                continue
            value, confidence = match["value"], row.confidence
            for following in text_rows[i + 1 : i + 1 + field.continues]:
                if any(other.regex.search(following.text) for other in document.fields.values()):
                    break
                value, confidence = value + following.text, min(confidence, following.confidence)
            if field.normalise == "upper":
                value = value.upper()
            fields[name] = parse_date(value) if field.kind == "date" else value
            confidences[name] = round(confidence, 4)
            break
    required = [n for n, f in document.fields.items() if f.required]
    missing = [n for n in required if n not in fields]
    code = fields.get(document.code.field, "")
    until = fields.get(document.expiry, "")
    try:
        expired = until != LONG_TERM and date.fromisoformat(until) < today
    except ValueError:  # unreadable date: not known to be expired; `complete` or the confidence decides
        expired = False
    return Extraction(
        doc_type=doc_type, fields=fields, confidences=confidences, missing=missing,
        code_valid=bool(code) and CHECKS[document.code.check](code), expired=expired,
        min_confidence=0.0 if missing else min((confidences[n] for n in required), default=0.0),
        code_confidence=confidences.get(document.code.field, 0.0),
    )
