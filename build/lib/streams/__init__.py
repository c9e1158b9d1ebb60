"""Tangram: a Kafka-native streaming dataflow for production AI.

The seven pieces of an AI application, each a folder of this package:
ingest (`streams.ingest`), features (`streams.features`), model serving
(`inference_workers`), rules (`streams.rules`), config, observability and the
model lifecycle. Every hop between them is a Kafka topic with an Avro contract
from `schemas/avro/`.
"""

import logging

__version__ = "0.1.0"

#: The one logger namespace of the project. Never configure the root logger.
logger = logging.getLogger("tangram")
logger.addHandler(logging.NullHandler())
