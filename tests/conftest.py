"""Both test tiers import the reference apps' plugin code and ``reference`` (where the apps live)."""

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for folder in (_TESTS, _TESTS.parent / "topologies" / "predictive_maintenance", _TESTS.parent / "topologies" / "document_intake"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
