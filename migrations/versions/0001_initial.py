"""Initial schema: threads (with watermark and tombstones), messages, runs.

Revision ID: 0001
Revises:
Create Date: 2026-11-22

Creates exactly the tables and indexes of `buffered_store/schema.py` (a test compares
them), written out explicitly so later changes to the code cannot rewrite history.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

TSTZ = postgresql.TIMESTAMP(timezone=True)


def _schema() -> str:
    # Set by migrations/env.py: every object lives in the configured schema.
    return str(context.config.attributes["schema"])


def upgrade() -> None:
    """Create the tables and indexes."""
    schema = _schema()
    op.create_table(
        "threads",
        sa.Column("thread_id", sa.Text(collation="C"), nullable=False),
        sa.Column("parent_thread_id", sa.Text(), nullable=True),
        sa.Column(
            "metadata",
            postgresql.JSONB(),
            nullable=False,
            server_default=sa.text("'{}'::jsonb"),
        ),
        sa.Column("created_at", TSTZ, nullable=True),
        sa.Column("updated_at", TSTZ, nullable=True),
        sa.Column("latest_run_id", sa.Text(), nullable=True),
        sa.Column("message_count", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("flushed_seq", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("flushed_stream_seq", sa.BigInteger(), nullable=True),
        sa.Column("deleted_at", TSTZ, nullable=True),
        sa.PrimaryKeyConstraint("thread_id", name="threads_pkey"),
        schema=schema,
    )
    op.create_index(
        "threads_live_updated_idx",
        "threads",
        [sa.text("updated_at DESC"), sa.text("thread_id DESC")],
        postgresql_where=sa.text("deleted_at IS NULL"),
        schema=schema,
    )
    op.create_table(
        "messages",
        sa.Column("thread_id", sa.Text(collation="C"), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column("message", postgresql.JSONB(), nullable=False),
        sa.Column("thread_seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("thread_id", "position", name="messages_pkey"),
        schema=schema,
    )
    op.create_table(
        "runs",
        sa.Column("run_id", sa.Text(collation="C"), nullable=False),
        sa.Column("thread_id", sa.Text(collation="C"), nullable=False),
        sa.Column("agent_id", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("parent_run_id", sa.Text(), nullable=True),
        sa.Column("created_at", TSTZ, nullable=False),
        sa.Column("updated_at", TSTZ, nullable=False),
        sa.Column("finished_at", TSTZ, nullable=True),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("record", postgresql.JSONB(), nullable=False),
        sa.Column("thread_seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", name="runs_pkey"),
        schema=schema,
    )
    for name, columns in (
        ("runs_thread_created_idx", ["thread_id", "created_at DESC", "run_id DESC"]),
        ("runs_status_created_idx", ["status", "created_at DESC", "run_id DESC"]),
        ("runs_created_idx", ["created_at DESC", "run_id DESC"]),
    ):
        op.create_index(name, "runs", [sa.text(c) for c in columns], schema=schema)


def downgrade() -> None:
    """Drop the tables (and with them their indexes)."""
    schema = _schema()
    for table in ("runs", "messages", "threads"):
        op.drop_table(table, schema=schema)
