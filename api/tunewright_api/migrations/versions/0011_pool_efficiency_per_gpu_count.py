"""a pool's measured efficiency is learned apart for jobs on one GPU and across several: records of the single-factor
form were learned against the figure one H100 had before 2026-12-07 (the published multi-GPU runs'), and are
forgotten (the pool learns again from its next windows)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

pools = sa.table("pools", sa.column("name", sa.String), sa.column("measured_efficiency", sa.JSON))


def upgrade() -> None:
    connection = op.get_bind()
    for name, measured in connection.execute(sa.select(pools.c.name, pools.c.measured_efficiency)).all():
        record = json.loads(measured) if isinstance(measured, str) else measured
        if isinstance(record, dict) and "factor" in record:
            connection.execute(pools.update().where(pools.c.name == name).values(measured_efficiency=None))


def downgrade() -> None:
    """The earlier form cannot read a record of this one: every pool forgets what it learned."""
    op.get_bind().execute(pools.update().values(measured_efficiency=None))
