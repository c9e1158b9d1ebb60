"""PP-OCR around three served models: pre-processing, box extraction, text-line batching, CTC decoding.

The models (``ppocr_det``, ``ppocr_cls``, ``ppocr_rec``) run wherever ``Infer`` sends a batch: Triton in
the OCR stage, onnxruntime in the benchmark's baseline. Everything else of the pipeline is here, written
for this app from the published PP-OCR method (a DB text detector's probability map → boxes; text lines
→ an upright 48-pixel-high strip → CTC greedy decoding over the recogniser's classes):

1. ``det_input``: the decoded RGB image scaled so its long side is at most ``det_limit`` and both sides
   are multiples of 32, normalised to [-1, 1], CHW;
2. ``text_boxes``: the probability map thresholded, each connected region's minimum-area rectangle
   kept if the mean probability inside is high enough, grown by the DB "unclip" distance
   (area × ratio / perimeter) and scaled back to the image;
3. ``crop_line``: each box cut out of the image by a perspective warp (tall boxes turned upright);
4. the direction classifier (optional: degradation L1 skips it) turns upside-down lines round, and a
   document whose lines mostly were is read in the reverse order;
5. ``rec_batches``: lines grouped by width so that one request pads little, each line 48 pixels high;
6. ``ctc_decode``: the most probable class per time step, repeats and blanks dropped; the line's
   confidence is the mean probability of the characters it kept.
"""

from __future__ import annotations

import asyncio
import io
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import cv2
import numpy as np
from PIL import Image

#: ``infer(model, batch)``: the model's output for a batch (first dimension: rows).
Infer = Callable[[str, np.ndarray], Awaitable[np.ndarray]]

DET, CLS, REC = "ppocr_det", "ppocr_cls", "ppocr_rec"
REC_HEIGHT = 48
CLS_WIDTH = 192


@dataclass(frozen=True)
class OcrSettings:
    """The knobs of the method (PP-OCR's published defaults where they have one)."""

    det_limit: int = 800  # longest side given to the detector
    det_threshold: float = 0.3  # pixel probability that counts as text
    box_threshold: float = 0.6  # mean probability inside a box to keep it
    unclip_ratio: float = 1.6  # how far a box grows (DB's shrink was undone by this)
    min_box_side: float = 3.0  # smaller boxes are noise
    max_boxes: int = 200
    cls_threshold: float = 0.9  # P(180°) above which a line is turned round
    rec_min_width: int = 96  # narrowest request: short lines (field labels) cost a third of the training width (320)
    rec_max_width: int = 1600
    rec_batch: int = 16  # lines per recognition request: lines of similar width, little padding


@dataclass(frozen=True)
class Line:
    """One text line read from a document: its text, confidence and box (4 corners, image pixels)."""

    text: str
    confidence: float
    box: tuple[tuple[float, float], ...]

    @property
    def top(self) -> float:
        return min(y for _, y in self.box)

    @property
    def bottom(self) -> float:
        return max(y for _, y in self.box)

    @property
    def left(self) -> float:
        return min(x for x, _ in self.box)


@dataclass
class Timings:
    """Seconds spent in each step of one batch of documents (the stage reports them as metrics)."""

    pre: float = 0.0
    det: float = 0.0
    boxes: float = 0.0
    cls: float = 0.0
    rec: float = 0.0
    decode: float = 0.0
    rec_requests: int = 0
    lines: int = 0
    by_model: dict[str, float] = field(default_factory=dict)


def decode_image(data: bytes) -> np.ndarray:
    """RGB pixels of an encoded image (the intake stage has checked and converted it already)."""
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def _normalise(pixels: np.ndarray) -> np.ndarray:
    """uint8 HWC → float32 CHW in [-1, 1] (PP-OCR's mean 0.5, std 0.5)."""
    return (pixels.astype(np.float32).transpose(2, 0, 1) / 127.5) - 1.0


def det_input(image: np.ndarray, limit: int) -> np.ndarray:
    """The detector's input for ``image``: long side ≤ ``limit``, sides multiples of 32, normalised."""
    h, w = image.shape[:2]
    ratio = min(1.0, limit / max(h, w))
    rh, rw = max(32, round(h * ratio / 32) * 32), max(32, round(w * ratio / 32) * 32)
    return _normalise(cv2.resize(image, (rw, rh), interpolation=cv2.INTER_LINEAR))


def _order(points: np.ndarray) -> np.ndarray:
    """Four corners as top-left, top-right, bottom-right, bottom-left."""
    by_x = points[np.argsort(points[:, 0])]
    left, right = by_x[:2], by_x[2:]
    tl, bl = left[np.argsort(left[:, 1])]
    tr, br = right[np.argsort(right[:, 1])]
    return np.array([tl, tr, br, bl], dtype=np.float32)


def text_boxes(prob: np.ndarray, shape: tuple[int, int], s: OcrSettings) -> list[np.ndarray]:
    """Boxes (4×2, image pixels) of the text regions of a probability map, in reading order."""
    mh, mw = prob.shape
    h, w = shape
    mask = (prob > s.det_threshold).astype(np.uint8)
    contours, _ = cv2.findContours(mask, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    boxes = []
    for contour in contours[: s.max_boxes * 4]:
        (cx, cy), (bw, bh), angle = cv2.minAreaRect(contour)
        if min(bw, bh) < s.min_box_side:
            continue
        x, y, cw, ch = cv2.boundingRect(contour)
        region = np.zeros((ch, cw), np.uint8)
        cv2.fillPoly(region, [contour.reshape(-1, 2) - (x, y)], 1)
        if float(prob[y:y + ch, x:x + cw][region > 0].mean()) < s.box_threshold:
            continue
        grow = bw * bh * s.unclip_ratio / (2 * (bw + bh))
        grown = ((cx, cy), (bw + 2 * grow, bh + 2 * grow), angle)
        if min(grown[1]) < s.min_box_side + 2:
            continue
        points = cv2.boxPoints(grown) * np.array([w / mw, h / mh], dtype=np.float32)
        points[:, 0] = np.clip(points[:, 0], 0, w - 1)
        points[:, 1] = np.clip(points[:, 1], 0, h - 1)
        boxes.append(_order(points))
        if len(boxes) >= s.max_boxes:
            break
    return sorted(boxes, key=lambda b: (round(float(b[:, 1].min()) / 12), float(b[:, 0].min())))


def crop_line(image: np.ndarray, box: np.ndarray) -> np.ndarray:
    """The text line inside ``box``, warped to an upright rectangle (a tall one turned a quarter)."""
    tl, tr, br, bl = box
    width = int(max(np.linalg.norm(tl - tr), np.linalg.norm(bl - br)))
    height = int(max(np.linalg.norm(tl - bl), np.linalg.norm(tr - br)))
    width, height = max(width, 1), max(height, 1)
    target = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
    crop = cv2.warpPerspective(image, cv2.getPerspectiveTransform(box, target), (width, height),
                               borderMode=cv2.BORDER_REPLICATE, flags=cv2.INTER_CUBIC)
    return np.rot90(crop) if height / width >= 1.5 else crop


def _strip(crop: np.ndarray, width: int, max_width: int) -> np.ndarray:
    """A line scaled to 48 pixels high (at most ``max_width`` wide), normalised, zero-padded to ``width``."""
    h, w = crop.shape[:2]
    resized_w = min(max_width, max(1, math.ceil(REC_HEIGHT * w / h)))
    strip = np.zeros((3, REC_HEIGHT, width), np.float32)
    strip[:, :, :resized_w] = _normalise(cv2.resize(crop, (resized_w, REC_HEIGHT), interpolation=cv2.INTER_LINEAR))
    return strip


def cls_input(crops: Sequence[np.ndarray]) -> np.ndarray:
    return np.stack([_strip(c, CLS_WIDTH, CLS_WIDTH) for c in crops]) if crops else np.zeros((0, 3, 48, CLS_WIDTH), np.float32)


def rec_batches(crops: Sequence[np.ndarray], s: OcrSettings) -> list[tuple[list[int], np.ndarray]]:
    """Lines grouped by width (narrowest first), each group one request of at most ``rec_batch`` lines,
    padded to its widest line rounded up to 32 pixels (so that requests of similar groups share a shape
    and Triton's batcher can merge them)."""
    widths = [min(s.rec_max_width, math.ceil(REC_HEIGHT * c.shape[1] / c.shape[0])) for c in crops]
    order = sorted(range(len(crops)), key=widths.__getitem__)
    batches = []
    for start in range(0, len(order), s.rec_batch):
        indices = order[start:start + s.rec_batch]
        width = max(s.rec_min_width, math.ceil(max(widths[i] for i in indices) / 32) * 32)
        batches.append((indices, np.stack([_strip(crops[i], width, s.rec_max_width) for i in indices])))
    return batches


def ctc_decode(probs: np.ndarray, characters: Sequence[str]) -> list[tuple[str, float]]:
    """Greedy CTC: per line the text and the mean probability of the characters kept."""
    best, score = probs.argmax(axis=2), probs.max(axis=2)
    out = []
    for classes, scores in zip(best, score):
        keep = classes != 0
        keep[1:] &= classes[1:] != classes[:-1]
        text = "".join(characters[c] for c in classes[keep])
        out.append((text, float(scores[keep].mean()) if keep.any() else 0.0))
    return out


class OcrEngine:
    """Reads documents with the three models behind ``infer``: detection per document, classification
    and recognition over every line of every document of the batch at once."""

    def __init__(self, infer: Infer, characters: Sequence[str], settings: OcrSettings = OcrSettings()):
        self.infer = infer
        self.characters = list(characters)
        self.settings = settings

    async def read(self, images: Sequence[np.ndarray], *, use_cls: bool = True,
                   timings: Timings | None = None) -> list[list[Line]]:
        """The lines of each image, in reading order."""
        t = timings or Timings()
        s = self.settings
        clock = time.perf_counter()
        inputs = [det_input(image, s.det_limit) for image in images]
        t.pre += time.perf_counter() - clock

        clock = time.perf_counter()
        maps = await asyncio.gather(*(self.infer(DET, x[None]) for x in inputs))
        t.det += time.perf_counter() - clock

        clock = time.perf_counter()
        boxes = [text_boxes(m[0, 0], image.shape[:2], s) for m, image in zip(maps, images)]
        crops, owner = [], []
        for doc, (image, doc_boxes) in enumerate(zip(images, boxes)):
            for box in doc_boxes:
                crops.append(crop_line(image, box))
                owner.append(doc)
        t.boxes += time.perf_counter() - clock

        flipped = np.zeros(len(crops), bool)
        if use_cls and crops:
            clock = time.perf_counter()
            x = cls_input(crops)
            parts = await asyncio.gather(*(self.infer(CLS, x[i:i + s.rec_batch]) for i in range(0, len(x), s.rec_batch)))
            probs = np.concatenate(parts)
            flipped = (probs.argmax(axis=1) == 1) & (probs.max(axis=1) > s.cls_threshold)
            crops = [np.rot90(c, 2) if f else c for c, f in zip(crops, flipped)]
            t.cls += time.perf_counter() - clock

        clock = time.perf_counter()
        batches = rec_batches(crops, s)
        t.pre += time.perf_counter() - clock
        clock = time.perf_counter()
        outputs = await asyncio.gather(*(self.infer(REC, x) for _, x in batches))
        t.rec += time.perf_counter() - clock
        t.rec_requests += len(batches)

        clock = time.perf_counter()
        texts: list[tuple[str, float]] = [("", 0.0)] * len(crops)
        for (indices, _), probs in zip(batches, outputs):
            for i, decoded in zip(indices, ctc_decode(probs, self.characters)):
                texts[i] = decoded
        lines: list[list[Line]] = [[] for _ in images]
        flips: list[list[bool]] = [[] for _ in images]
        k = 0
        for doc, doc_boxes in enumerate(boxes):
            for box in doc_boxes:
                text, conf = texts[k]
                lines[doc].append(Line(text, conf, tuple((float(x), float(y)) for x, y in box)))
                flips[doc].append(bool(flipped[k]))
                k += 1
        for doc, image in enumerate(images):
            if flips[doc] and sum(flips[doc]) * 2 > len(flips[doc]):  # upside down: read from the other end
                h, w = image.shape[:2]
                lines[doc] = sorted((Line(l.text, l.confidence, tuple((w - 1 - x, h - 1 - y) for x, y in l.box))
                                     for l in lines[doc]), key=lambda l: (round(l.top / 12), l.left))
        t.decode += time.perf_counter() - clock
        t.lines += len(crops)
        return lines
