"""GPU pools (the local machine and described ones) and plans: what tunewright would run, before running it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from sqlmodel import select

from tunewright_api.auth import AdminToken, CurrentTenant, SessionDep
from tunewright_api.errors import ApiError
from tunewright_api.models import GpuPool, ListEnvelope
from tunewright_operator.planner import calibration
from tunewright_operator.planner.hardware import GPUS, LINKS, Pool
from tunewright_operator.planner.jobs import plan_job
from tunewright_operator.planner.models import ModelProfile, from_hf_config, lookup
from tunewright_operator.planner.search import NoPlan, Plan
from tunewright_operator.spec import FineTuneJobSpec

router = APIRouter(prefix="/v1", tags=["pools and plans"])
LOCAL = "local"


class _Camel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class PoolCreate(_Camel):
    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    gpu: Literal[tuple(GPUS)]  # type: ignore[valid-type]
    gpus_per_node: int = Field(gt=0, le=64)
    max_nodes: int = Field(gt=0, le=4096)
    intra_node: Literal[tuple(LINKS)]  # type: ignore[valid-type]
    inter_node: Literal[tuple(LINKS)] | None = None  # type: ignore[valid-type]
    price_per_gpu_hour: float = Field(ge=0, alias="pricePerGPUHour")
    host_memory_gib: float | None = Field(default=None, gt=0, alias="hostMemoryGiB",
                                          description="Host memory per node (CPU offload); default 2x its GPU memory")


def pool_public(p: GpuPool) -> dict:
    return {"object": "pool", "name": p.name, "gpu": p.gpu, "gpusPerNode": p.gpus_per_node, "maxNodes": p.max_nodes,
            "intraNode": p.intra_node, "interNode": p.inter_node, "pricePerGPUHour": p.price_per_gpu_hour,
            "hostMemoryGiB": p.host_memory_gib}


def gpus_found() -> list[str]:
    """This machine's NVIDIA GPUs, by name (none when there is no driver)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in listing.stdout.splitlines() if line.strip()] if listing.returncode == 0 else []


def local_pool(request: Request) -> dict:
    settings = request.app.state.settings
    found = gpus_found()
    return {"object": "pool", "name": LOCAL, "gpusFound": found, "gpusUsed": settings.local_gpus,
            "cpus": os.cpu_count(), "workers": settings.local_gpus or settings.local_workers, "pricePerGPUHour": 0.0,
            "description": "this machine, through the local backend"
                           + ("" if settings.local_gpus else " (training on the CPU: set TUNEWRIGHT_LOCAL_GPUS)"
                              if found else " (no GPU found: training on the CPU)")}


@router.get("/pools")
def list_pools(request: Request, session: SessionDep, _: CurrentTenant) -> ListEnvelope:
    described = session.exec(select(GpuPool).order_by(GpuPool.name)).all()
    return ListEnvelope(data=[local_pool(request), *map(pool_public, described)])


@router.post("/pools", status_code=201)
def create_pool(body: PoolCreate, session: SessionDep, _: AdminToken) -> dict:
    if body.name == LOCAL or session.get(GpuPool, body.name) is not None:
        raise ApiError(409, f"pool {body.name} exists", "name", "exists")
    pool = GpuPool(**body.model_dump())
    session.add(pool)
    session.commit()
    return pool_public(pool)


class PlanRequest(_Camel):
    spec: FineTuneJobSpec
    pool: str
    dataset_tokens: int | None = Field(default=None, gt=0, description="Tokens in the training set (for epochs).")


class PlanResponse(BaseModel):
    object: str = "plan"
    pool: str
    model: dict
    plan: Plan


def profile_for(source: str) -> ModelProfile:
    profile = lookup(source)
    if profile is not None:
        return profile
    config = Path(source.removeprefix("hf://")) / "config.json"
    if config.is_file():
        return from_hf_config(source, json.loads(config.read_text()))
    raise ApiError(422, f"unknown model {source}: not in the catalog and no readable config.json",
                   "spec.model.source", "unknown_model")


@router.post("/plans")
def make_plan(body: PlanRequest, session: SessionDep, _: CurrentTenant) -> PlanResponse:
    """Dry run: the plan, its predictions, and the alternatives rejected with their reasons."""
    described = session.get(GpuPool, body.pool)
    if described is None:
        hint = " (the local pool runs on this machine's CPUs; the planner models GPU pools)" if body.pool == LOCAL else ""
        raise ApiError(422, f"no GPU pool {body.pool}{hint}", "pool", "unknown_pool")
    pool = Pool(described.name, calibration.for_gpu(described.gpu), described.gpus_per_node, described.max_nodes,
                LINKS[described.intra_node], LINKS[described.inter_node] if described.inter_node else None,
                described.price_per_gpu_hour, described.host_memory_gib)
    profile = profile_for(body.spec.model.source)
    cal, _ = calibration.load()
    try:
        chosen = plan_job(body.spec, pool, cal, profile, body.dataset_tokens)
    except NoPlan as err:
        raise ApiError(422, str(err), "spec", "no_plan") from None
    except ValueError as err:
        raise ApiError(422, str(err), "spec", "invalid_value") from None
    return PlanResponse(pool=pool.name, model={"name": profile.name, "parameters": profile.params,
                                               "layers": profile.layers, "hidden": profile.hidden}, plan=chosen)
