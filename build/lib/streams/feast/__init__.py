"""Feast: the declared feature sets registered with it, and its Redis store as Tangram's online store.

- ``layout``: Feast's Redis key layout (entity keys, murmur3 fields, ``Value`` protos, ``_ts``,
  TTL), written by the engines and read by the rules *without* Feast: protobuf and mmh3 only,
  importable from every environment;
- ``repo``: a Feast feature repository generated from ``topologies/features/*.yaml``
  (entity, push source with a file batch source, feature view) and ``apply``;
- ``bridge``: backfill. ``sync`` consumes a features topic (Confluent-framed Avro) and pushes the
  rows with ``FeatureStore.push`` (a new or emptied Redis refilled from the topic);
  ``get_online`` reads through ``FeatureStore.get_online_features``.

``repo``'s ``apply`` and ``bridge`` run in Feast's own environment, ``.venv-feast``
(``streams/feast/requirements-feast.txt``, created by ``make setup``): Feast pulls dask, pandas
and pyarrow and constrains redis and prometheus-client apart from the application.

    python -m streams.feast apply --redis 127.0.0.1:6379 --home .tangram     # project: the app, `pm`
    python -m streams.feast get   --home .tangram dev-001 dev-002
    python -m streams.feast sync  --home .tangram --bootstrap 127.0.0.1:9092 --registry http://127.0.0.1:8081
"""
