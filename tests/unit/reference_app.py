"""Where the reference application lives, named once for the deploy tests (compose, chart, docs).

``APP`` is the app folder, in the repository and, under ``/app``, in the image. ``TOPOLOGY`` is the
file its topology is read from today; when the app becomes a folder (issue #17) it is ``PROJECT_ROOT / APP``.
"""

from streams import PROJECT_ROOT

APP = "topologies/predictive_maintenance"
IMAGE_APP = f"/app/{APP}"
TOPOLOGY = PROJECT_ROOT / "topologies" / "predictive_maintenance.yaml"
