"""Schema migrations: the newest revision is exactly the models, and upgrading keeps the data."""

import json

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlmodel import Session, SQLModel, select

from tunewright_api.auth import issue_token
from tunewright_api.db import make_engine, migrate
from tunewright_api.models import GpuPool, Tenant


def url_for(database_url, tmp_path):
    return database_url or f"sqlite:///{tmp_path / 'db.sqlite'}"


def test_migrations_build_exactly_the_models(database_url, tmp_path):
    engine = make_engine(url_for(database_url, tmp_path))
    migrate(engine)
    with engine.connect() as connection:
        differences = compare_metadata(MigrationContext.configure(connection, opts={"compare_type": True}),
                                       SQLModel.metadata)
    engine.dispose()
    assert differences == [], "models.py changed without a migration: add one with alembic --autogenerate"


def test_an_upgrade_keeps_the_data(database_url, tmp_path):
    engine = make_engine(url_for(database_url, tmp_path))
    migrate(engine, "0001")  # a database from the first release
    with Session(engine) as session:
        issue_token(session, "kept")
    migrate(engine)
    migrate(engine)  # idempotent
    with Session(engine) as session:
        assert session.exec(select(Tenant.name)).all() == ["kept"]
        assert session.exec(select(GpuPool)).all() == []  # the new table exists
    engine.dispose()


OLD_GPU_PLAN = {"strategy": "fsdp", "workers": 2, "useGPU": True, "microBatch": 4, "gradAccum": 2, "cpuOffload": False,
                "explanation": "local pool (2 x H200): ...",
                "predicted": {"peak_memory_gib": 30.5, "step_seconds": 0.5, "matmul_seconds": 0.3,
                              "memory_bound_seconds": 0.1, "optimizer_seconds": 0.05, "comm_seconds": 0.05,
                              "exposed_comm_seconds": 0.01, "comm_share": 0.1, "exposed_comm_share": 0.02,
                              "mfu": 0.4, "tokens_per_second": 5e4, "duration_seconds": 60.0, "cost_usd": 0.26,
                              "memory_breakdown_gib": {"activations": 10.0}},  # offload keys came later
                "rejected": [{"strategy": "single", "gpus": 1, "reason": "slower"}]}
OLD_CPU_PLAN = {"strategy": "ddp", "workers": 2, "useGPU": False, "microBatch": 4, "gradAccum": 1,
                "explanation": "local pool: ddp on 2 CPU workers"}


def test_plans_stored_before_0004_become_job_plans(database_url, tmp_path):
    """0004 rewrites the hand-built plan dicts of earlier releases as the typed, camelCase JobPlan."""
    from sqlalchemy import text

    from tunewright_api.models import Job, MetricPoint
    from tunewright_core.spec import JobPlan

    engine = make_engine(url_for(database_url, tmp_path))
    migrate(engine, "0003")
    with Session(engine) as session:
        tenant, _, _ = issue_token(session, "old")
        tenant_id = tenant.id
    insert = text("INSERT INTO job (id, tenant_id, status, model, spec, plan, config, created_at, step, "
                  "trained_tokens, telemetry_token_hash, run_dir) VALUES (:id, :tenant, 'succeeded', 'm', '{}', "
                  ":plan, :config, '2026-11-30 12:00:00', 0, 0, '', '')")
    with engine.begin() as connection:
        for job_id, plan, config in [
            ("ftjob-gpu", OLD_GPU_PLAN, {"strategy": {"activation_checkpointing": True}}),
            ("ftjob-cpu", OLD_CPU_PLAN, None),
        ]:
            connection.execute(insert, {"id": job_id, "tenant": tenant_id, "plan": json.dumps(plan),
                                        "config": json.dumps(config)})
        point = text("INSERT INTO metricpoint (job_id, step, time, data) VALUES ('ftjob-gpu', :step, 0, :data)")
        for step, loss in [(1, 2.0), (2, 1.5), (2, 1.4)]:  # step 2 sent twice before 0004 (a resumed run)
            connection.execute(point, {"step": step, "data": json.dumps({"loss": loss})})
    migrate(engine)
    with Session(engine) as session:
        gpu, cpu = session.get(Job, "ftjob-gpu").plan, session.get(Job, "ftjob-cpu").plan
        points = session.exec(select(MetricPoint).order_by(MetricPoint.step)).all()
    engine.dispose()
    assert [(p.step, p.data["loss"]) for p in points] == [(1, 2.0), (2, 1.4)]  # the latest of a step kept
    assert isinstance(gpu, JobPlan) and (gpu.device, gpu.gpus, gpu.shard_group) == ("gpu", 2, 2)
    assert gpu.activation_checkpointing and gpu.predicted.peak_memory_gib == 30.5 and gpu.predicted.cost_usd == 0.26
    assert gpu.rejected[0].reason == "slower"
    assert (cpu.device, cpu.workers, cpu.gpus, cpu.predicted, cpu.micro_batch) == ("cpu", 2, 0, None, 4)


def test_a_model_holding_column_reads_a_row_it_cannot_validate_as_none_and_renders_as_json(caplog):
    """One row this version cannot read (written by another, say) never stops the queries that load every
    job; a generated migration writes the column as JSON."""
    from tunewright_api.models import ClusterRef, ModelJSON, render_for_alembic

    column = ModelJSON(ClusterRef)
    assert column.process_result_value({"namespace": "a", "name": "b", "missed": 2}, None) == ClusterRef(
        namespace="a", name="b", missed=2)
    assert column.process_result_value({"namespace": "a", "shard": 3}, None) is None  # no name
    assert "a stored ClusterRef does not validate here" in caplog.text
    assert column.process_bind_param(ClusterRef(namespace="a", name="b"), None) == {"namespace": "a", "name": "b",
                                                                                   "missed": 0}
    assert render_for_alembic("type", column, None) == "sa.JSON()"


def test_a_model_holding_column_without_a_value_is_sql_null(tmp_path):
    from tunewright_api.models import Job

    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    migrate(engine)
    with Session(engine) as session:
        tenant = Tenant(name="team-a")
        session.add(tenant)
        session.flush()
        session.add(Job(id="ftjob-1", tenant_id=tenant.id, model="m", spec={}))
        session.commit()
        assert session.exec(select(Job.id).where(Job.plan.is_(None), Job.cluster.is_(None))).all() == ["ftjob-1"]


def test_0011_forgets_efficiencies_learned_in_the_single_factor_form(database_url, tmp_path):
    """Learned against the figure one H100 had before 2026-12-07; a record of the per-GPU-count form is kept."""
    engine = make_engine(url_for(database_url, tmp_path))
    migrate(engine, "0010")
    old = {"gpu": "H100", "factor": 1.4, "windows": 12, "lastJob": "ftjob-a", "measuredAt": 1.0}
    new = {"gpu": "H100", "severalGPUs": {"factor": 1.1, "windows": 3, "lastJob": "ftjob-b", "measuredAt": 2.0}}
    with Session(engine) as session:
        for name, measured in (("old", old), ("new", new), ("none", None)):
            session.add(GpuPool(name=name, gpu="H100", gpus_per_node=8, max_nodes=1, intra_node="nvlink4",
                                price_per_gpu_hour=3.0, learn_links=True, measured_efficiency=measured))
        session.commit()
    migrate(engine)
    with Session(engine) as session:
        kept = {p.name: p.measured_efficiency for p in session.exec(select(GpuPool)).all()}
    engine.dispose()
    assert kept == {"old": None, "new": new, "none": None}
