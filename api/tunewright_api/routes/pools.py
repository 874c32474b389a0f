"""GPU pools (the local machine and described ones) and plans: what tunewright would run, before running it."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter
from pydantic import Field
from sqlmodel import select

from tunewright_api.auth import AdminToken, CurrentTenant, SessionDep
from tunewright_api.deps import BackendDep, SettingsDep
from tunewright_api.errors import ApiError
from tunewright_api.models import GpuPool
from tunewright_api.routes.links import links_from
from tunewright_api.schemas import (
    DescribedPool,
    PlannedModel,
    PlanResponse,
    PoolCreate,
    PoolDescription,
    PoolList,
    PoolPublic,
)
from tunewright_api.services import jobs
from tunewright_api.services.plans import plan_on, pool_of, profile_for
from tunewright_core.planner.jobs import dataset_tokens_of
from tunewright_core.pools import readable
from tunewright_core.spec import CamelModel, FineTuneJobSpec, MeasuredEfficiency, MeasuredLinks

router = APIRouter(prefix="/v1", tags=["pools and plans"])


def pool_public(p: GpuPool) -> DescribedPool:
    return DescribedPool.model_validate({
        "object": "pool", "name": p.name, "gpu": p.gpu, "gpusPerNode": p.gpus_per_node, "maxNodes": p.max_nodes,
        "intraNode": p.intra_node, "interNode": p.inter_node, "pricePerGPUHour": p.price_per_gpu_hour,
        "hostMemoryGiB": p.host_memory_gib, "learnLinks": p.learn_links,
        "measuredLinks": readable(MeasuredLinks, p.measured_links),
        "measuredEfficiency": readable(MeasuredEfficiency, p.measured_efficiency)})


@router.get("/pools")
def list_pools(session: SessionDep, backend: BackendDep, _: CurrentTenant) -> PoolList:
    described = session.exec(select(GpuPool).order_by(GpuPool.name)).all()
    return PoolList(data=[*map(PoolPublic.model_validate, backend.pools()),
                          *(PoolPublic(pool_public(p)) for p in described)])


@router.get("/pools/{name}")
def get_pool(name: str, session: SessionDep, backend: BackendDep, _: CurrentTenant) -> PoolPublic:
    """A described pool, or one of the backend's own (this machine's, or a cluster's GPUPool)."""
    if (described := session.get(GpuPool, name)) is not None:
        return PoolPublic(pool_public(described))
    for own in backend.pools():
        if own["name"] == name:
            return PoolPublic.model_validate(own)
    raise ApiError(404, f"no GPU pool {name}", "name", "not_found")


@router.post("/pools", status_code=201, responses=links_from(201, "name", "name", ("get", "/v1/pools/{name}")))
def create_pool(body: PoolCreate, session: SessionDep, backend: BackendDep, _: AdminToken) -> DescribedPool:
    if body.name in {p["name"] for p in backend.pools()} or session.get(GpuPool, body.name) is not None:
        raise ApiError(409, f"pool {body.name} exists", "name", "exists")
    pool = GpuPool(**body.model_dump())
    session.add(pool)
    session.commit()
    return pool_public(pool)


@router.delete("/pools/{name}/measured-links")
def forget_measured_links(name: str, session: SessionDep, _: AdminToken) -> DescribedPool:
    """Back to the declared links (after a network change, say); learning goes on if learnLinks is set."""
    pool = session.get(GpuPool, name)
    if pool is None:
        raise ApiError(404, f"no described GPU pool {name}", "name", "not_found")
    pool.measured_links = None
    session.add(pool)
    session.commit()
    return pool_public(pool)


DESCRIBED_POOL = "described"  # the name a plan on `poolSpec` carries


class PlanRequest(CamelModel):
    spec: FineTuneJobSpec
    pool: str | None = Field(default=None, description="A pool by name (GET /v1/pools); or give poolSpec.")
    pool_spec: PoolDescription | None = Field(default=None, description=(
        "A pool described here, for this plan only (nothing is kept; no admin token needed): the fields of "
        f"POST /v1/pools but the name; the plan names it {DESCRIBED_POOL!r}."))
    dataset_tokens: int | None = Field(default=None, gt=0, description="Tokens in the training set (for epochs).")


@router.post("/plans")
def make_plan(body: PlanRequest, session: SessionDep, backend: BackendDep, settings: SettingsDep,
              tenant: CurrentTenant) -> PlanResponse:
    """Dry run: the plan, its predictions, and the alternatives rejected with their reasons."""
    if (body.pool is None) == (body.pool_spec is None):
        raise ApiError(422, "name a pool (pool) or describe one (poolSpec): one of the two", "pool", "invalid_value")
    if body.pool_spec is not None:
        pool_name, pool = DESCRIBED_POOL, pool_of(GpuPool(name=DESCRIBED_POOL, **body.pool_spec.model_dump()))
    else:
        described = session.get(GpuPool, body.pool)
        pool_name, pool = body.pool, pool_of(described) if described else backend.pool(body.pool)
    if pool is None:
        own = {p["name"] for p in backend.pools()}
        hint = (" (that pool is this machine's: its jobs are planned when submitted, and the planner models GPU "
                "pools described with POST /v1/pools)" if body.pool in own else "")
        raise ApiError(422, f"no GPU pool {body.pool}{hint}", "pool", "unknown_pool")
    spec = jobs.readable_model(body.spec, session=session, tenant=tenant, data_dir=settings.data_dir,
                               model_roots=settings.model_roots, param="spec.model.source")
    profile = profile_for(spec.model.source, param="spec.model.source")
    dataset_tokens = body.dataset_tokens
    # an uploaded file (a dry run may name one not uploaded yet): its size says about how many tokens an epoch
    # takes, and the sizes the spec leaves open are chosen from it as submitting the spec would choose them
    train = None
    with contextlib.suppress(ApiError):
        train = jobs.dataset_file(session=session, tenant=tenant, value=spec.dataset.train, param="spec.dataset.train")
    if train is not None:
        spec, _ = jobs.fit_to_data(spec, train, spec_param="spec")
        if dataset_tokens is None and spec.hyperparameters.max_steps is None:
            dataset_tokens = dataset_tokens_of(train.bytes)
    chosen = plan_on(spec=spec, profile=profile, pool=pool, dataset_tokens=dataset_tokens, spec_param="spec")
    return PlanResponse(pool=pool_name, model=PlannedModel(name=profile.name, parameters=profile.params,
                                                           layers=profile.layers, hidden=profile.hidden), plan=chosen)
