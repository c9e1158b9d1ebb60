"""The declared feature sets registered with Feast, and Feast's Redis online store fed from Kafka.

Runs in its own environment, ``.venv-feast`` (``streams/feast/requirements-feast.txt``,
created by ``make setup``): Feast pulls dask, pandas and pyarrow and constrains redis and
prometheus-client apart from the application.

- ``repo``: a Feast feature repository generated from ``topologies/features/*.yaml``
  (entity, push source with a file batch source, feature view) and ``apply``;
- ``bridge``: ``sync`` consumes a features topic (Confluent-framed Avro) and pushes the rows
  to Feast's online store with ``FeatureStore.push``; ``get_online`` reads them back.

    python -m streams.feast apply --redis 127.0.0.1:6379 --home .tangram
    python -m streams.feast sync  --home .tangram --bootstrap 127.0.0.1:9092 --registry http://127.0.0.1:8081
    python -m streams.feast get   --home .tangram dev-001 dev-002
"""
