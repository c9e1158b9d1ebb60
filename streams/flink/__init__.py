"""The cluster feature engine: the declared feature sets as Flink SQL jobs (Flink environment).

``job`` generates and runs the job (in ``.venv-flink``): the JVM decodes (``udf/``, Flink's own
avro-confluent deserializer), windows and aggregates; ``functions`` holds the vectorized Python it
calls. ``launcher`` resolves the jars with Maven (``pom.xml``, ``udf/pom.xml``) and runs the job on a
local mini-cluster; ``cluster`` starts a standalone JobManager and TaskManagers and submits to any.
"""
