"""The runtime imports no application: not the reference apps' plugin code, not their folders, not the tests.

Two checks, each failing with the offending module named: a static one over every import statement of the
runtime's packages (``streams``, ``inference_workers``), and a dynamic one that imports every runtime module
in a fresh interpreter and looks at where everything it loaded came from.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

from reference import REPO

RUNTIME = ("streams", "inference_workers")
#: Folders of the repository that hold applications or tests: the runtime never imports from them.
APP_FOLDERS = ("topologies", "tests", "benchmarks")


def _runtime_files():
    for package in RUNTIME:
        yield from sorted((REPO / package).rglob("*.py"))


def _app_modules() -> set[str]:
    """Top-level names importable from an app folder (its plugin packages and modules)."""
    names = set()
    for app in (REPO / "topologies").iterdir():
        for entry in app.iterdir() if app.is_dir() else ():
            if entry.suffix == ".py" or (entry / "__init__.py").is_file():
                names.add(entry.stem)
    return names


def test_no_runtime_module_imports_an_app_module_statically():
    apps = _app_modules() | {"reference", "isolation", "pm_app"}
    assert "pm_app" in _app_modules(), "the reference app's plugin package moved: update this test"
    offenders = []
    for path in _runtime_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                          if n.split(".")[0] in apps]
    assert offenders == []


def test_importing_every_runtime_module_loads_nothing_from_an_app_folder():
    modules = [".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
               for p in _runtime_files() if p.name != "__main__.py"]
    # the Flink job and the Feast repository import their own environments' packages: checked statically only
    modules = [m for m in modules if not m.startswith(("streams.flink.job", "streams.flink.functions",
                                                         "streams.feast.bridge", "streams.features.faust_job"))]
    script = f"""
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
print(json.dumps({{n: getattr(m, "__file__", None) for n, m in sys.modules.items()}}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.splitlines()[-1])
    from_apps = sorted(f"{name} ({path})" for name, path in loaded.items()
                       if path and any(path.startswith(str(REPO / folder)) for folder in APP_FOLDERS))
    assert from_apps == []
    assert len(modules) > 50  # the check looked at the whole runtime
