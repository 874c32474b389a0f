"""files' sha256, so a client can find the upload it already made instead of uploading the same data again

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("sha256", sa.String(), nullable=True))
        batch.create_index("ix_files_sha256", ["sha256"])


def downgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.drop_index("ix_files_sha256")
        batch.drop_column("sha256")
