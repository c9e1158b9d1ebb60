"""The document-intake app's plugin code: OCR pre/post-processing, documents and their checks, stages, simulator.

The runtime imports this package from the app folder (``topologies/document_intake``) when the topology
names it (``kind: intake_app.stages:Ocr``, ``models.build``, ``simulator.kind``); it imports the runtime,
never the other way.
"""

from __future__ import annotations

from pathlib import Path

#: The app folder: this package's parent.
APP_DIR = Path(__file__).resolve().parent.parent
