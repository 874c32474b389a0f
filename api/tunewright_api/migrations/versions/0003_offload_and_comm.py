"""pool host memory (CPU offload plans) and a job's measured communication share

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 (generated with alembic --autogenerate from models.py)
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pools") as batch:
        batch.add_column(sa.Column("host_memory_gib", sa.Float(), nullable=True))
    with op.batch_alter_table("job") as batch:
        batch.add_column(sa.Column("comm", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.drop_column("comm")
    with op.batch_alter_table("pools") as batch:
        batch.drop_column("host_memory_gib")
