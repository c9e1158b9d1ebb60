"""The ``models.build`` hook: PP-OCRv4 from the installed ``rapidocr-onnxruntime`` wheel into a Triton repository.

Nothing is trained and nothing is downloaded: the wheel ships the ONNX files of PaddleOCR's PP-OCRv4
text detector, its text recogniser (Chinese and Latin characters, the dictionary stored in the ONNX
file's metadata) and the mobile v2.0 text-direction classifier. The hook copies each one to
``<model>/1/model.onnx`` beside the ``config.pbtxt`` this app declares, and checks the recogniser's
dictionary against the output's labels file the app declares (``ppocr_rec/characters.txt``, one class
per line in output order: the CTC blank, the dictionary, the space; written from the ONNX file when it
is missing). The OCR stage reads the classes there: the model's contract, not the library's code.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from importlib.metadata import version
from importlib.resources import files
from pathlib import Path

import onnxruntime as ort

#: Triton model name → the file of the wheel it serves.
MODELS: dict[str, str] = {
    "ppocr_det": "ch_PP-OCRv4_det_infer.onnx",
    "ppocr_rec": "ch_PP-OCRv4_rec_infer.onnx",
    "ppocr_cls": "ch_ppocr_mobile_v2.0_cls_infer.onnx",
}
#: The labels file of the recogniser's output (its ``label_filename``).
CHARACTERS = "characters.txt"
#: How the CTC blank (class 0) is written in the labels file: a line that is no character of the dictionary.
BLANK = "<blank>"
#: How the space (the last class) is written: a bare space would be stripped as an empty line by readers.
SPACE = "<space>"


def wheel_model(name: str) -> Path:
    """The path of one of the wheel's ONNX files (raises FileNotFoundError when the wheel lacks it)."""
    path = Path(str(files("rapidocr_onnxruntime"))) / "models" / MODELS[name]
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the rapidocr-onnxruntime wheel has no {MODELS[name]} (make setup installs it)")
    return path


def dictionary(onnx_path: Path) -> list[str]:
    """The recogniser's classes in output order, from the ``character`` metadata of its ONNX file."""
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    characters = session.get_modelmeta().custom_metadata_map["character"].splitlines()
    classes = [BLANK, *characters, SPACE]
    width = session.get_outputs()[0].shape[-1]
    if len(classes) != width:
        raise ValueError(f"{onnx_path}: {len(characters)} characters + blank + space != output width {width}")
    return classes


def read_characters(model_dir: Path) -> list[str]:
    """The recogniser's classes as the labels file declares them (blank and space restored)."""
    lines = (model_dir / CHARACTERS).read_text(encoding="utf-8").split("\n")
    return [{BLANK: "", SPACE: " "}.get(c, c) for c in lines if c]


def _labels(model_dir: Path, classes: list[str]) -> None:
    """Write the recogniser's labels file, or check that the one the app declares matches the ONNX file."""
    path = model_dir / CHARACTERS
    text = "\n".join(classes) + "\n"
    if not path.is_file():
        path.write_text(text, encoding="utf-8")
    elif path.read_text(encoding="utf-8") != text:
        raise ValueError(f"{path} differs from the dictionary of {model_dir / '1' / 'model.onnx'}: the app declares "
                         "another recogniser than the wheel ships (delete the file to take the wheel's)")


def build(repository: Path, force: bool = False) -> str:
    """Copy the three models into ``repository`` (version 1) unless they are there already, and write the card."""
    done = []
    for name, filename in MODELS.items():
        target = repository / name / "1" / "model.onnx"
        source = wheel_model(name)
        if force or not target.is_file() or target.stat().st_size != source.stat().st_size:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        if name == "ppocr_rec":
            _labels(repository / name, dictionary(target))
        digest = hashlib.sha256(target.read_bytes()).hexdigest()
        card = {"name": name, "version": "1", "sha256": digest, "source": f"rapidocr-onnxruntime {version('rapidocr-onnxruntime')}: {filename}",
                "dataset_version": "paddleocr-pp-ocrv4-release"}
        (repository / name / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
        done.append(f"{name} v1 ({target.stat().st_size / 1e6:.1f} MB, sha256 {digest[:12]})")
    return f"PP-OCR models from rapidocr-onnxruntime {version('rapidocr-onnxruntime')}: " + ", ".join(done)
