"""Postgres tables (SQLAlchemy Core). The Alembic migrations create exactly these.

Tables are defined without a schema; the configured schema is applied at run time with
SQLAlchemy's ``schema_translate_map``. Columns are plain and typed so Spark can read them
over JDBC efficiently; JSON documents are jsonb.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP

metadata = MetaData()

TSTZ = TIMESTAMP(timezone=True)
ID = Text(collation="C")
"""Identifiers sort by code point, as the read overlay merges them in Python."""

threads = Table(
    "threads",
    metadata,
    Column("thread_id", ID, primary_key=True),
    Column("parent_thread_id", Text, nullable=True),
    Column("metadata", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("created_at", TSTZ, nullable=True),
    Column("updated_at", TSTZ, nullable=True),
    Column("latest_run_id", Text, nullable=True),
    Column("message_count", Integer, nullable=False, server_default=text("0")),
    Column("flushed_seq", BigInteger, nullable=False, server_default=text("0")),
    Column("flushed_stream_seq", BigInteger, nullable=True),
    Column("deleted_at", TSTZ, nullable=True),
    Index(
        "threads_live_updated_idx",
        text("updated_at DESC"),
        text("thread_id DESC"),
        postgresql_where=text("deleted_at IS NULL"),
    ),
)
"""One row per thread. A deleted thread keeps a tombstone row (`deleted_at` set) so its
`flushed_seq` survives and late entries stay stale."""

messages = Table(
    "messages",
    metadata,
    Column("thread_id", ID, nullable=False),
    Column("position", Integer, nullable=False),
    Column("role", Text, nullable=False),
    Column("message", JSONB, nullable=False),
    Column("thread_seq", BigInteger, nullable=False),
    PrimaryKeyConstraint("thread_id", "position", name="messages_pkey"),
)

runs = Table(
    "runs",
    metadata,
    Column("run_id", ID, primary_key=True),
    Column("thread_id", ID, nullable=False),
    Column("agent_id", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("parent_run_id", Text, nullable=True),
    Column("created_at", TSTZ, nullable=False),
    Column("updated_at", TSTZ, nullable=False),
    Column("finished_at", TSTZ, nullable=True),
    Column("steps", Integer, nullable=False),
    Column("input_tokens", BigInteger, nullable=False),
    Column("output_tokens", BigInteger, nullable=False),
    Column("record", JSONB, nullable=False),
    Column("thread_seq", BigInteger, nullable=False),
    Index("runs_thread_created_idx", "thread_id", text("created_at DESC"), text("run_id DESC")),
    Index("runs_status_created_idx", "status", text("created_at DESC"), text("run_id DESC")),
    Index("runs_created_idx", text("created_at DESC"), text("run_id DESC")),
)
"""`record` holds the whole `RunRecord` as JSON; the other columns are its queryable parts."""
