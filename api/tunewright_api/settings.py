"""Service settings, from the environment (TUNEWRIGHT_*) or a .env file."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TUNEWRIGHT_", env_file=".env", extra="ignore")

    data_dir: Path = Path(".tunewright")
    database_url: str | None = None  # default: SQLite file in data_dir
    admin_token: str | None = None  # bootstrap: a token of the admin tenant, created at startup
    # /metrics: a scraper presenting it (or an admin token) also gets each running job's series, labelled by
    # tenant and job; without a token, only totals (jobs by status, request latencies by route template)
    metrics_token: str | None = None
    backend: Literal["local", "kubernetes"] = "local"
    public_url: str = "http://127.0.0.1:8000"  # what workers use to reach the telemetry endpoint
    max_running_jobs: int = 1  # local backend: jobs at once (each takes the machine's CPUs or GPUs)
    local_workers: int = 2  # local backend on CPU: Ray workers per job
    local_gpus: int = 0  # local backend: GPUs of this machine to use (0: train on the CPU)
    local_gpu_type: str | None = None  # catalog name (H200, H100, ...); default: what nvidia-smi reports
    local_gpu_link: str = "nvlink4"  # how the local GPUs are joined (a planner link name)
    local_price_per_gpu_hour: float = 0.0
    local_ray: bool = True  # run jobs on Ray (False: one plain process per worker under torchrun, e.g. for tests)
    ray_address: str | None = None  # the Ray cluster jobs run on; default: the server's own (local_shared_ray)
    # jobs join one Ray of the server's own, started with it and kept for its life (False: each job starts one)
    local_shared_ray: bool = True
    max_upload_bytes: int = 512 * 2**20
    # local paths a model may be read from (its config.json by the API, its weights by local jobs); unset:
    # any path but the system's own folders; [] (the chart's setting): none, only hub names and volumes
    model_roots: list[Path] | None = None
    kubernetes_namespace_prefix: str = "tw-"  # kubernetes backend: tenant t's jobs live in namespace <prefix>t
    kubernetes_sync_seconds: float = 2.0  # kubernetes backend: how often FineTuneJobs are read back
    kubernetes_checkpoint_storage: str | None = None  # kubernetes backend: for jobs naming none (pvc://claim/path)

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'tunewright.db').resolve()}"


@lru_cache
def get_settings() -> Settings:
    return Settings()
