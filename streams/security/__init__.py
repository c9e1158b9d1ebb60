"""Security: who may reach what, and with which credentials (docs/security.md).

* :mod:`streams.security.kafka`: the one typed Kafka client security config, rendered for
  librdkafka, aiokafka and the Java client;
* :mod:`streams.security.acls`: Kafka ACLs and Redis ACL users generated from the topology;
* :mod:`streams.security.local`: the secured local stack's principals, provisioned and worn;
* :mod:`streams.security.pki` and :mod:`streams.security.secrets`: its CA, certificates and passwords;
* :mod:`streams.security.keys`: the gateways' API keys, hashed, in the config center;
* :mod:`streams.security.erase`: an entity's erasure, recorded.
"""
