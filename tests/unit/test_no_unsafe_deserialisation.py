"""No code runs from data: the runtime never unpickles, evals, execs or loads YAML with an unsafe loader.

Bytes from a topic, a request or a file an app names are data. A pickle (or ``yaml.load`` with a
full loader, ``numpy.load(allow_pickle=True)``, ``pandas.read_pickle``) read from them runs whatever
their author wrote; with an open broker that is remote code execution (the Faust changelog was
one). This test reads the syntax tree of every module of the runtime and the reference apps, so
a mention in a docstring or a comment is not a finding and an aliased import is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = [ROOT / "streams", ROOT / "inference_workers", ROOT / "topologies"]

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
UNSAFE_BUILTINS = {"eval", "exec"}
UNSAFE_CALLS = {("yaml", "unsafe_load"), ("yaml", "full_load"), ("yaml", "unsafe_load_all"), ("yaml", "full_load_all"),
                ("pandas", "read_pickle"), ("pd", "read_pickle"), ("torch", "load")}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def modules() -> list[Path]:
    return sorted(p for folder in SCANNED for p in folder.rglob("*.py") if ".venv" not in p.parts)


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def findings(source: str, name: str = "<module>") -> list[str]:
    """Every unsafe deserialisation in ``source``, as ``name:line: what``."""
    tree = ast.parse(source)
    out: list[str] = []
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            out.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            callee = _dotted(node.func)
            keywords = {k.arg: k.value for k in node.keywords if k.arg}
            if isinstance(node.func, ast.Name) and callee in UNSAFE_BUILTINS:
                out.append(f"{where}: {callee}()")
            elif tuple(callee.rsplit(".", 1)) in UNSAFE_CALLS:
                out.append(f"{where}: {callee}()")
            elif callee in ("yaml.load", "yaml.load_all"):
                loader = keywords.get("Loader") or (node.args[1] if len(node.args) > 1 else None)
                if loader is None or _dotted(loader).rsplit(".", 1)[-1] not in SAFE_YAML_LOADERS:
                    out.append(f"{where}: {callee}() without a safe loader")
            elif callee.endswith(".load") and callee.split(".")[0] in ("np", "numpy"):
                flag = keywords.get("allow_pickle")
                if isinstance(flag, ast.Constant) and flag.value is True or flag is not None and not isinstance(flag, ast.Constant):
                    out.append(f"{where}: {callee}(allow_pickle=...)")
    return out


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_deserialises_nothing_unsafely(path: Path) -> None:
    assert findings(path.read_text(), str(path.relative_to(ROOT))) == []


@pytest.mark.parametrize("source", [
    "import pickle", "import cPickle as p", "from pickle import loads", "import dill",
    "eval(x)", "exec(code)", "yaml.load(text)", "yaml.load(text, Loader=yaml.FullLoader)",
    "yaml.load(text, yaml.UnsafeLoader)", "yaml.unsafe_load(text)", "yaml.full_load(text)",
    "np.load(f, allow_pickle=True)", "numpy.load(f, allow_pickle=flag)", "pd.read_pickle(path)",
])
def test_the_scan_finds_each_unsafe_form(source: str) -> None:
    assert findings(source), source


@pytest.mark.parametrize("source", [
    "yaml.safe_load(text)", "yaml.load(text, Loader=yaml.SafeLoader)", "yaml.load(text, Loader=CSafeLoader)",
    "np.load(f, allow_pickle=False)", "np.load(f)", "client.eval(script, 1, key)", "json.loads(b)",
    '"""pickle.loads is unsafe"""', "# eval(x)",
])
def test_the_scan_leaves_safe_forms_alone(source: str) -> None:
    assert findings(source) == [], source
