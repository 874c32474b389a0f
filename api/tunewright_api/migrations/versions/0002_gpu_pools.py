"""gpu pools

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 (generated with alembic --autogenerate from models.py)
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pools",
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("gpu", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("gpus_per_node", sa.Integer(), nullable=False),
        sa.Column("max_nodes", sa.Integer(), nullable=False),
        sa.Column("intra_node", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("inter_node", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("price_per_gpu_hour", sa.Float(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("pools")
