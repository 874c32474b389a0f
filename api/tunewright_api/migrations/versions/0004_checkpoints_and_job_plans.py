"""checkpoints registered by the runtime; one metric point per step; stored plans as the typed JobPlan

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 (table generated with alembic --autogenerate from models.py; the data step by hand)
"""

import json

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# The planner's snake_case prediction keys whose camelCase is not the plain conversion.
PREDICTED_ALIASES = {"peak_memory_gib": "peakMemoryGiB", "host_memory_gib_per_node": "hostMemoryGiBPerNode",
                     "cost_usd": "costUSD", "memory_breakdown_gib": "memoryBreakdownGiB"}


# predictions the planner added after the first plans were stored (CPU offload): none was offloaded then
ADDED_PREDICTIONS = {"offloadSeconds": 0.0, "exposedOffloadSeconds": 0.0, "hostMemoryGiBPerNode": 0.0}


def camel(key: str) -> str:
    first, *rest = key.split("_")
    return PREDICTED_ALIASES.get(key) or first + "".join(word.title() for word in rest)


def job_plan(old: dict, config: dict | None) -> dict:
    """0003's hand-built plan ({strategy, workers, useGPU, ...}) as a JobPlan; what it lacked comes from the
    runtime config the job was started with."""
    strategy_config = (config or {}).get("strategy", {})
    workers, strategy = old["workers"], old["strategy"]
    shard_group = {"fsdp": workers, "hsdp": strategy_config.get("hsdp_shard_size") or 1}.get(strategy, 1)
    predicted = old.get("predicted")
    return {"pool": "local", "device": "gpu" if old.get("useGPU") else "cpu", "strategy": strategy,
            "workers": workers, "gpus": workers if old.get("useGPU") else 0, "nodes": 1,
            "microBatch": old["microBatch"], "gradAccum": old["gradAccum"],
            "activationCheckpointing": bool(strategy_config.get("activation_checkpointing", False)),
            "shardGroup": shard_group, "cpuOffload": bool(old.get("cpuOffload", False)),
            "predicted": {**ADDED_PREDICTIONS, **{camel(k): v for k, v in predicted.items()}} if predicted else None,
            "explanation": old.get("explanation", ""), "rejected": old.get("rejected", [])}


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("uri", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("train_loss", sa.Float(), nullable=True),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["job.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "step"),
    )
    op.create_index(op.f("ix_checkpoints_job_id"), "checkpoints", ["job_id"], unique=False)
    metric = sa.table("metricpoint", sa.column("id", sa.Integer), sa.column("job_id", sa.String),
                      sa.column("step", sa.Integer))
    connection = op.get_bind()
    newest = (sa.select(sa.func.max(metric.c.id)).group_by(metric.c.job_id, metric.c.step)).scalar_subquery()
    connection.execute(metric.delete().where(metric.c.id.not_in(newest)))  # earlier duplicates: the latest wins
    with op.batch_alter_table("metricpoint") as batch:
        batch.create_unique_constraint("uq_metricpoint_job_id_step", ["job_id", "step"])
    job = sa.table("job", sa.column("id", sa.String), sa.column("plan", sa.JSON), sa.column("config", sa.JSON))
    for row in connection.execute(sa.select(job.c.id, job.c.plan, job.c.config)).all():
        plan = json.loads(row.plan) if isinstance(row.plan, str) else row.plan
        if plan and "workers" in plan and "pool" not in plan:
            config = json.loads(row.config) if isinstance(row.config, str) else row.config
            connection.execute(job.update().where(job.c.id == row.id).values(plan=job_plan(plan, config)))


def downgrade() -> None:
    with op.batch_alter_table("metricpoint") as batch:
        batch.drop_constraint("uq_metricpoint_job_id_step", type_="unique")
    op.drop_index(op.f("ix_checkpoints_job_id"), table_name="checkpoints")
    op.drop_table("checkpoints")
