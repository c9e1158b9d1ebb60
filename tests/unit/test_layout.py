"""The test tree itself: pytest imports test modules by basename, so two files may not share one."""

from collections import Counter

from reference import REPO as PROJECT_ROOT


def test_test_modules_have_unique_basenames():
    names = Counter(p.name for p in (PROJECT_ROOT / "tests").rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
