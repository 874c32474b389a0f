"""how much text a file's examples hold (all, and the longest one's), so a job's sizes can follow from its data

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("characters", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("longest_characters", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.drop_column("longest_characters")
        batch.drop_column("characters")
