"""Development helpers, never imported by the library at run time: local NATS and
Postgres servers on free ports (`services`), a three-node NATS cluster (`cluster`), a
standalone Spark master and worker from the installed pyspark (`spark_standalone`) and
`python -m buffered_store.dev.demo`.
"""
