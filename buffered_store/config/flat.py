"""The flat attributes of the configurations, declared for type checkers: one plain
class per role naming its fields, which a configuration derives from next to
`Composed`. The values are set when a configuration is built (`Composed.__init__`);
`tests/unit/test_config_roles.py` keeps these declarations equal to the roles' fields.
"""

from __future__ import annotations

from buffered_store.config.roles import ReadConsistency


class ConnectionFields:
    """`ConnectionSettings`'s fields as attributes of a configuration."""

    nats_url: str
    credentials: str | None
    tls_ca_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None
    connect_timeout_s: float
    request_timeout_s: float
    read_from: str


class WalLayoutFields:
    """`WalLayout`'s fields as attributes of a configuration."""

    stream_name: str
    hot_bucket: str
    quarantine_bucket: str
    consumer_name: str
    max_age_s: float | None
    retain_flushed_s: float
    wal_max_bytes: int | None
    duplicate_window_s: float
    replicas: int
    ack_wait_s: float
    max_ack_pending: int


class FlushPolicyFields:
    """`FlushPolicy`'s fields as attributes of a configuration."""

    flush_interval_s: float
    flush_batch_size: int
    flush_batch_bytes: int
    poison_attempts: int


class WriterFields:
    """`WriterSettings`'s fields as attributes of a configuration."""

    read_consistency: ReadConsistency
    checkpoint_timeout_s: float
    drain_on_close: bool
    drain_timeout_s: float
    recent_window: int
    cursor_cache_threads: int
    entry_cache_bytes: int
    cursor_cache_bytes: int


class ThreadRunFields:
    """`ThreadRunSettings`'s fields as attributes of a configuration."""

    check_snapshots: bool
    run_claim_grace_s: float
    hot_linger_s: float | None
