"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
${imports if imports else ""}

revision: str = ${repr(up_revision)}
down_revision: str | None = ${repr(down_revision)}
branch_labels: str | None = ${repr(branch_labels)}
depends_on: str | None = ${repr(depends_on)}


def _schema() -> str:
    # Set by migrations/env.py: every object lives in the configured schema.
    return str(context.config.attributes["schema"])


def upgrade() -> None:
    """Upgrade the schema."""
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    """Downgrade the schema."""
    ${downgrades if downgrades else "pass"}
