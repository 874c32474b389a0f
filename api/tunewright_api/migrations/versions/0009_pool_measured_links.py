"""pools that learn their links' bandwidth from the jobs that ran on them (opt-in)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pools") as batch:
        batch.add_column(sa.Column("learn_links", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("measured_links", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("pools") as batch:
        batch.drop_column("measured_links")
        batch.drop_column("learn_links")
