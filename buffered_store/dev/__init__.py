"""Development helpers, never imported by the library at run time: local NATS and
Postgres servers on free ports (`nats_server`, `postgres_server`, or in containers:
`containers`), what they share (`common`, `processes`), picking and starting them
(`services`), a three-node NATS cluster (`cluster`), a standalone Spark master and worker
from the installed pyspark (`spark_standalone`) and `python -m buffered_store.dev.demo`.
"""
