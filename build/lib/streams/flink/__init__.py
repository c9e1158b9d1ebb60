"""The cluster feature engine: the declared feature sets as PyFlink jobs (Flink environment).

``job`` is the PyFlink program (runs in ``.venv-flink``); ``launcher`` starts it from the
application environment on a local mini-cluster, with the connector jars Maven resolved
(``streams/flink/pom.xml``).
"""
