"""Planning on a GPU pool: model profiles, pools from their descriptions, the planner's answer or why not."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from sqlmodel import Session, select

from tunewright_api.errors import ApiError
from tunewright_api.models import GpuPool, Job
from tunewright_api.names import name_problem
from tunewright_core.planner import calibration
from tunewright_core.planner.hardware import Pool
from tunewright_core.planner.jobs import as_planned, plan_job, workload
from tunewright_core.planner.models import ModelProfile, from_hf_config, lookup
from tunewright_core.planner.search import NoPlan
from tunewright_core.pools import (
    catalog_compute_seconds,
    learns_efficiency,
    learnt_efficiency,
    learnt_links,
    planner_pool,
)
from tunewright_core.spec import FineTuneJobSpec, JobPlan

# what a hub id looks like (name, or org/name: no `..`, one slash): anything else is a path, checked as one,
# since the run would read it relative to its own folder
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
SYSTEM_FOLDERS = tuple(Path(p) for p in ("/proc", "/sys", "/dev", "/etc", "/root", "/run", "/var/run", "/boot"))


def within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def is_hub_name(source: str) -> bool:
    """A source `check_model_source` passed as a hub name (a local one it returns absolute)."""
    named = source.removeprefix("hf://")
    return not source.startswith("pvc://") and bool(HUB_ID.match(named)) and not Path(named).is_absolute()


def check_model_source(source: str, roots: list[Path] | None, *, param: str, data_dir: Path,
                       own_exports: Callable[[], list[Path]]) -> str:
    """The source as the job must name it: a local path resolved (links and `..` followed), so the run reads
    the folder checked here and not whatever a link points at by then.

    A local path is read by this server: only under the allowed roots (never the system's folders), and never
    inside the server's own data folder (other tenants' datasets and exported models) but for the submitting
    tenant's own exports (`own_exports`: resolved folders, asked for only then); so a spec cannot make it read,
    or reveal the existence of, files elsewhere."""
    if source.startswith("pvc://"):
        return source  # a volume: the workers read it, this server does not
    named = source.removeprefix("hf://")
    if (problem := name_problem(named)) is not None:  # before any file call, which would fail on it
        raise ApiError(422, f"{source!r} {problem}: a model is a hub name (org/name), a volume (pvc://claim/path) "
                            "or a local path", param, "invalid_value")
    if HUB_ID.match(named) and not Path(named).exists():
        return source  # a hub name (org/name): nothing here is read
    if "://" in source:
        raise ApiError(422, f"{source!r}: a model is a hub name (org/name, hf://org/name), a volume "
                            "(pvc://claim/path) or a local path", param, "invalid_value")
    if not Path(named).expanduser().is_absolute():  # relative to where the server happens to run: refused
        raise ApiError(422, f"{source!r}: a local model path must be absolute", param, "invalid_value")
    path = Path(named).expanduser().resolve()
    allowed = [Path(r).resolve() for r in roots] if roots is not None else None
    if allowed is None:
        refused = any(within(path, folder) for folder in SYSTEM_FOLDERS)
    else:
        refused = not any(within(path, root) for root in allowed)
    if refused:
        where = ", ".join(map(str, allowed)) if allowed else "no local path (set TUNEWRIGHT_MODEL_ROOTS)"
        raise ApiError(422, f"{source!r} is not where this server reads models from (allowed: {where})", param,
                       "model_path_not_allowed")
    if within(path, data_dir.resolve()) and not any(within(path, export) for export in own_exports()):
        raise ApiError(422, f"{source!r} is inside this server's data folder, which holds every tenant's datasets "
                            "and models: a job may read only your own jobs' exports there (result.export of "
                            "GET /v1/jobs/{id}); name one of those, or a model folder outside the data folder",
                       param, "model_path_not_allowed")
    if not (path / "config.json").is_file():  # said now, not as a traceback from the run a minute later
        raise ApiError(422, f"{source!r}: no model there (a model is a folder with a config.json; a hub model is "
                            "named org/name)", param, "model_not_found")
    return str(path)


def profile_for(source: str, *, param: str) -> ModelProfile:
    """The catalog's profile of a model, or one read from its config.json."""
    profile = lookup(source)
    if profile is not None:
        return profile
    try:
        config = Path(source.removeprefix("hf://")) / "config.json"
        if config.is_file():
            return from_hf_config(source, json.loads(config.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:  # unreadable, not JSON, no model keys
        raise ApiError(422, f"cannot profile model {source}: {err}", param, "unknown_model") from None
    raise ApiError(422, f"unknown model {source}: not in the catalog and no readable config.json", param,
                   "unknown_model")


def pool_of(described: GpuPool) -> Pool:
    """The planner's pool; with learnLinks, each link at the bandwidth the pool's jobs measured and its GPU
    at the compute efficiency they measured."""
    return planner_pool(described.name, described, described.measured_links, described.measured_efficiency)


def learn_links(session: Session, job: Job, transfer_seconds: float, at: float) -> str | None:
    """Fold a profiler window's measured transfer time into the described pool the job was planned on,
    where that pool learns its links (opt-in); what was learnt, for the job's events."""
    plan = job.plan
    if plan is None:
        return None
    pool = session.exec(select(GpuPool).where(GpuPool.name == plan.pool).with_for_update()).first()
    if pool is None or not pool.learn_links:
        return None
    learnt = learnt_links(plan, pool.name, pool.intra_node, pool.inter_node, pool.measured_links or {},
                          transfer_seconds, job.id, at)
    if learnt is None:
        return None
    pool.measured_links, said = learnt
    session.add(pool)
    return said


def learn_efficiency(session: Session, job: Job, step_seconds: float, exposed_comm_seconds: float,
                     at: float) -> str | None:
    """Fold a profiler window's measured step (less its exposed communication) into the described pool the
    job was planned on, where that pool learns (learnLinks); what was learnt, for the job's events."""
    plan = job.plan
    if plan is None or not learns_efficiency(plan):
        return None
    pool = session.exec(select(GpuPool).where(GpuPool.name == plan.pool).with_for_update()).first()
    if pool is None or not pool.learn_links:
        return None
    learnt = efficiency_learnt(job, pool.name, pool.gpu, pool.measured_efficiency, pool_of(pool), step_seconds,
                               exposed_comm_seconds, at)
    if learnt is None:
        return None
    pool.measured_efficiency, said = learnt
    session.add(pool)
    return said


def efficiency_learnt(job: Job, pool_name: str, gpu: str, measured: dict | None, pool: Pool, step_seconds: float,
                      exposed_comm_seconds: float, at: float) -> tuple[dict, str] | None:
    """A pool's measured efficiency with the job's window folded in, and what was learnt; None where the
    window teaches nothing (described pools and GPUPools alike)."""
    plan = job.plan
    if plan is None or not learns_efficiency(plan):
        return None
    spec = FineTuneJobSpec.model_validate(job.spec)
    try:
        profile = profile_for(spec.model.source, param="model.source")
    except ApiError:
        return None  # the model's config is gone since the plan: nothing to compare the window with
    cal, _ = calibration.load()
    catalog = catalog_compute_seconds(plan, as_planned(workload(spec, profile, dataset_tokens=1), plan), pool, cal)
    return learnt_efficiency(plan, pool_name, gpu, measured, catalog, step_seconds, exposed_comm_seconds, job.id,
                             at)


def plan_on(*, spec: FineTuneJobSpec, profile: ModelProfile, pool: Pool, dataset_tokens: int | None,
            spec_param: str | None) -> JobPlan:
    """The planner's plan for `spec` on `pool`; 422 with the planner's reasons when nothing fits.

    `spec_param` is where the spec sits in the request body (None: the body is the spec)."""
    def where(field: str) -> str:
        return ".".join(filter(None, (spec_param, field)))

    cal, _ = calibration.load()
    try:
        return plan_job(spec, pool, cal, profile, dataset_tokens)
    except NoPlan as err:
        raise ApiError(422, str(err), where("resources"), "no_plan") from None
    except ValueError as err:  # "<field>: why" names the spec's field; else it is about the hyperparameters
        field, _, _ = str(err).partition(":")
        named = field if re.fullmatch(r"[A-Za-z]+(\.[A-Za-z]+)*", field) else "hyperparameters"
        raise ApiError(422, str(err), where(named), "invalid_value") from None
