"""Development helpers, never imported by the library at run time: local NATS and
Postgres servers on free ports (`services`), a three-node NATS cluster (`cluster`) and
`python -m buffered_store.dev.demo`.
"""
