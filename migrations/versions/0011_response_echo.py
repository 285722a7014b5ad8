"""responses.echo: the request's members its response object repeats (tools, tool_choice, metadata), as
OpenAI's Response does, kept apart from the request so that a response's final event reads a few columns

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-08
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# Requests stored before could not hold metadata; a row whose request names neither of these keeps no echo.
ECHOED = ("tools", "tool_choice")


def upgrade() -> None:
    op.add_column("responses", sa.Column("echo", sa.JSON().with_variant(JSONB(), "postgresql")))
    postgres = op.get_bind().dialect.name == "postgresql"
    for name in ECHOED:
        if postgres:
            op.execute(f"UPDATE responses SET echo = COALESCE(echo, '{{}}') || jsonb_build_object('{name}', "
                       f"request -> '{name}') WHERE request ? '{name}'")
        else:  # SQLite: -> gives JSON, which json_set takes as JSON (not as a string)
            op.execute(f"UPDATE responses SET echo = json_set(COALESCE(echo, '{{}}'), '$.{name}', "
                       f"request -> '$.{name}') WHERE request -> '$.{name}' IS NOT NULL")


def downgrade() -> None:
    # Not a batch copy of the table on SQLite (see 0006).
    op.execute("ALTER TABLE responses DROP COLUMN echo")
