"""The local backend: each job is a separate process running the training runtime on a local Ray.

This machine is the pool: with `local_gpus` its GPUs, planned through the planner like any GPU pool;
without, DDP over `local_workers` CPU workers (the planner models GPUs, not CPUs). A queue admits at most
`max_running_jobs` at once (each takes the machine's CPUs or GPUs). Cancel ends the run's process group.

A job has at most one run whatever instant the API dies at: its launch is committed before anything
starts, and the run claims its folder through `local_launcher` (a lock held while it lives, and `run.pid`).
When the API restarts, `reconcile` re-attaches to runs still alive, starts launches that never started,
and settles the rest from what they left, so no job stays "running" forever.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from tunewright_api.backends import AlreadyFinished, Planned, Ticker, local_launcher
from tunewright_api.backends.local_launcher import LOCK_FILE, PID_FILE, REFUSED, lock_held
from tunewright_api.backends.local_ray import ServerRay, auth_environment
from tunewright_api.errors import ApiError
from tunewright_api.models import Job, StoredFile, add_event, now
from tunewright_api.services import telemetry
from tunewright_api.services.plans import learn_efficiency, learn_links, plan_on, profile_for
from tunewright_api.settings import Settings
from tunewright_api.states import TERMINAL, transition
from tunewright_core.jobconfig import runtime_config
from tunewright_core.planner import calibration
from tunewright_core.planner.hardware import GPUS, LINKS, Pool, gpu_from_product_name
from tunewright_core.planner.jobs import check_fits_model, dataset_tokens_of
from tunewright_core.spec import FineTuneJobSpec, JobPlan

log = logging.getLogger(__name__)
LOG_TAIL_LINES = 20
# Where the runtime's one-line reason is looked for: torchrun and Ray print their own reports after it.
REASON_SEARCH_LINES = 400
POOL = "local"
MAX_CPU_MICRO_BATCH = 8  # sequences per forward pass on a CPU worker: more only costs memory
# What a job's processes inherit from the API's environment: what Python, PyTorch, CUDA, NCCL and Hugging
# Face read, nothing else. The API's own secrets (admin token, database URL) and a Ray address it happens
# to have stay out: a job runs on the Ray cluster the backend gives it, or on one it starts.
INHERITED_VARIABLES = frozenset({"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "TZ", "TMPDIR", "PYTHONPATH",
                                 "VIRTUAL_ENV", "LD_LIBRARY_PATH", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"})
INHERITED_PREFIXES = ("LC_", "CUDA_", "NCCL_", "NVIDIA_", "HF_", "TRANSFORMERS_", "TORCH_", "OMP_", "MKL_")
LAUNCHER = Path(local_launcher.__file__)  # run by path: it imports nothing of the API


def _alive(pid: int, run_dir: str) -> bool:
    """True when `pid` is still this job's runtime (pids are reused: check its command line)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return run_dir in cmdline


def job_environment(api_environment: dict[str, str], telemetry_token: str, ray_address: str | None) -> dict[str, str]:
    """The environment of a job's processes (pure: the API's environment in, the job's out)."""
    env = {k: v for k, v in api_environment.items()
           if k in INHERITED_VARIABLES or k.startswith(INHERITED_PREFIXES)}
    env["TUNEWRIGHT_TELEMETRY_TOKEN"] = telemetry_token
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    return env


def ray_environment(api_environment: dict[str, str]) -> dict[str, str]:
    """The environment of the server's Ray, whose workers run every job's code: a job's, less its token (each
    job passes its own to its workers), with the runtime and core importable wherever they are."""
    env = job_environment(api_environment, "", None)
    del env["TUNEWRIGHT_TELEMETRY_TOKEN"]
    roots = [str(Path(spec.origin).parent.parent) for name in ("tunewright_jobs", "tunewright_core")
             if (spec := importlib.util.find_spec(name)) is not None and spec.origin]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*roots, *filter(None, [env.get("PYTHONPATH")])]))
    return env


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


def cpu_plan(spec: FineTuneJobSpec, workers: int) -> JobPlan:
    """DDP over CPU workers (pure): the global batch split evenly, the largest micro-batch that divides it."""
    strategy = spec.resources.strategy
    if strategy == "auto":
        strategy = "ddp" if workers > 1 else "single"
    if strategy == "single":
        workers = 1
    if strategy == "hsdp":
        raise ApiError(422, "hsdp needs several nodes; the local pool is one machine", "resources.strategy",
                       "invalid_value")
    batch = spec.hyperparameters.sequences_per_step
    unit = "preference pairs" if spec.method.objective == "dpo" else "sequences"  # dpo's batch counts pairs
    if batch % workers:
        raise ApiError(422, f"a global batch of {batch} {unit} does not divide over {workers} workers",
                       "hyperparameters.globalBatchSize", "invalid_value")
    per_worker = batch // workers
    micro = max(m for m in range(1, min(per_worker, MAX_CPU_MICRO_BATCH) + 1) if per_worker % m == 0)
    if spec.resources.precision == "fp8":
        raise ApiError(422, "fp8 products run on a GPU's FP8 tensor cores, and the local pool is this machine's "
                            "CPUs: set resources.precision bf16, or submit to a GPU pool", "resources.precision",
                       "invalid_value")
    # a 4-bit base where the spec asks for one; auto keeps bf16 here, where no GPU memory is to be saved
    nf4 = spec.method.type == "lora" and spec.method.lora.quantization == "nf4"
    if nf4 and strategy not in ("single", "ddp"):
        raise ApiError(422, f"a 4-bit (nf4) base is not sharded: strategy {strategy} cannot hold it; use auto, single "
                            "or ddp, or method.lora.quantization none", "resources.strategy", "invalid_value")
    # bf16 weights and moments where the spec asks for them; auto keeps fp32 masters, as for the base above
    light = spec.method.type == "full" and spec.hyperparameters.optimizer_state == "bf16"
    why = (f"local pool: {strategy} on {workers} CPU worker{'s' if workers > 1 else ''} (Ray, gloo), micro-batch "
           f"{micro} x {per_worker // micro} accumulation{f' x {workers} workers' if workers > 1 else ''} = {batch} "
           f"{unit} per step"
           f"{', the base in 4-bit NF4 (QLoRA)' if nf4 else ''}"
           f"{', bf16 weights and moments (stochastic rounding)' if light else ''}")
    return JobPlan(pool=POOL, device="cpu", strategy=strategy, workers=workers, gpus=0, micro_batch=micro,
                   grad_accum=per_worker // micro, shard_group=workers if strategy == "fsdp" else 1,
                   quantization="nf4" if nf4 else "none", optimizer_state="bf16" if light else "fp32",
                   explanation=why)


class LocalBackend:
    runs_here = True

    def __init__(self, settings: Settings, engine: Engine, poll_seconds: float = 0.5):
        self.settings, self.engine = settings, engine
        self.jobs_root = (settings.data_dir / "jobs").resolve()
        self._children: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._scheduler = Ticker("tunewright-local-backend", self.tick, poll_seconds, at_once=False)
        shared = settings.local_ray and settings.local_shared_ray and not settings.ray_address
        self._ray = ServerRay(settings.data_dir, os.cpu_count() or 1, settings.local_gpus,
                              ray_environment(dict(os.environ))) if shared else None

    # --- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        self.reconcile()
        self._scheduler.start()
        if self._ray is not None:  # warm before the first job asks for it
            threading.Thread(target=self._warm_ray, name="tunewright-ray-start", daemon=True).start()

    def _warm_ray(self) -> None:
        try:
            self._ray.head()
        except OSError as err:  # the first job that needs it tries again and fails saying why
            log.warning("%s", err)

    def stop(self) -> None:
        """Stop scheduling; running jobs go on (a restarted API re-attaches to them, and to the server's Ray
        they run on, which stops here only when no job runs)."""
        self._scheduler.stop(timeout=5)
        if self._ray is not None:
            with Session(self.engine) as session:
                running = session.exec(select(Job).where(Job.status == "running")).first()
            if running is None:
                self._ray.stop()

    # --- the pool and plans ---------------------------------------------------------------------------
    def pools(self) -> list[dict]:
        found, settings = gpus_found(), self.settings
        return [{"object": "pool", "name": POOL, "gpusFound": found, "gpusUsed": settings.local_gpus,
                 "cpus": os.cpu_count(), "workers": settings.local_gpus or settings.local_workers,
                 "pricePerGPUHour": settings.local_price_per_gpu_hour,
                 "description": "this machine, through the local backend"
                 + ("" if settings.local_gpus else " (training on the CPU: set TUNEWRIGHT_LOCAL_GPUS)"
                    if found else " (no GPU found: training on the CPU)")}]

    def pool(self, name: str) -> Pool | None:
        return None  # this machine is planned when a job is submitted (its GPUs are found then)

    def learn_links(self, session: Session, job: Job, transfer_seconds: float, at: float) -> str | None:
        return learn_links(session, job, transfer_seconds, at)  # the described pool of the plan's name

    def learn_efficiency(self, session: Session, job: Job, step_seconds: float, exposed_comm_seconds: float,
                         at: float) -> str | None:
        return learn_efficiency(session, job, step_seconds, exposed_comm_seconds, at)

    def plan(self, spec: FineTuneJobSpec, train: StoredFile) -> Planned:
        settings = self.settings
        if settings.local_gpus == 0:
            try:  # the sizes that follow from the model, when the model can be profiled here
                profile = profile_for(spec.model.source, param="model.source")
                check_fits_model(spec, profile)
            except ApiError:
                profile = None  # not profiled here (e.g. a hub model): the runtime checks it when it loads it
            except ValueError as err:
                raise ApiError(422, str(err), str(err).partition(":")[0], "invalid_value") from None
            return Planned(cpu_plan(spec, max(1, min(settings.local_workers, os.cpu_count() or 1))), profile)
        # this machine's GPUs as a one-node pool, planned like any other
        gpu_type = settings.local_gpu_type or next(filter(None, map(gpu_from_product_name, gpus_found())), None)
        if gpu_type not in GPUS:
            raise ApiError(422, f"cannot plan for local GPUs of type {gpu_type!r}: set TUNEWRIGHT_LOCAL_GPU_TYPE to "
                                f"one of {', '.join(GPUS)}", "resources", "unknown_gpu")
        host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        pool = Pool(POOL, calibration.for_gpu(gpu_type), settings.local_gpus, 1, LINKS[settings.local_gpu_link],
                    None, settings.local_price_per_gpu_hour, host_gib)
        profile = profile_for(spec.model.source, param="model.source")
        chosen = plan_on(spec=spec, profile=profile, pool=pool, dataset_tokens=dataset_tokens_of(train.bytes),
                         spec_param=None)
        return Planned(chosen.model_copy(update={
            "explanation": f"local pool ({settings.local_gpus} x {gpu_type}): {chosen.explanation}"}), profile)

    # --- the work ------------------------------------------------------------------------------------
    def run_dir(self, job: Job) -> Path:
        return self.jobs_root / job.id

    def submit(self, session: Session, job: Job, spec: FineTuneJobSpec, planned: Planned, train: StoredFile,
               validation: StoredFile | None, telemetry_token: str) -> None:
        """The run folder, its runtime config, and the per-job telemetry secret (owner-only file)."""
        run_dir = self.run_dir(job)
        job.config = runtime_config(
            spec, planned.plan, name=job.id, output_dir=str(run_dir / "output"), train=train.path,
            validation=validation.path if validation else None, checkpoint_storage=str(run_dir / "checkpoints"),
            telemetry_endpoint=f"{self.settings.public_url.rstrip('/')}/v1/internal/jobs/{job.id}/telemetry")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "job.json").write_text(json.dumps(job.config, indent=2))
        token_file = run_dir / "telemetry.token"
        token_file.touch(mode=0o600)
        token_file.write_text(telemetry_token)
        job.run_dir = str(run_dir)

    def _metrics_file(self, job: Job) -> Path:
        """Where the run writes its telemetry records (the runtime's default unless its config names one)."""
        config = job.config or {}
        return Path((config.get("metrics") or {}).get("path") or Path(config.get("output_dir", job.run_dir))
                    / "metrics.jsonl")

    def logs(self, job: Job, lines: int) -> list[str]:
        log_file = self.run_dir(job) / "run.log"
        try:
            with log_file.open(errors="replace") as fh:
                return [line.rstrip("\n") for line in deque(fh, maxlen=lines)]
        except OSError:
            return []

    def forget(self, job: Job) -> None:
        """The run's folder: its config, log, checkpoints (unless stored elsewhere) and export."""
        run_dir = self.run_dir(job)
        if run_dir.is_dir():
            # renamed first: a half-removed folder never sits under the job's name
            doomed = run_dir.with_name(f".{run_dir.name}.deleting")
            run_dir.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def tick(self) -> None:
        with self._lock, Session(self.engine) as session:
            for job in session.exec(select(Job).where(Job.status == "running")).all():
                self._settle_each(session, job, restarted=False)
            active = session.exec(select(Job).where(Job.status == "running")).all()
            free = self.settings.max_running_jobs - len(active)
            if free > 0:
                queued = session.exec(select(Job).where(Job.status == "queued").order_by(Job.created_at)).all()
                for job in queued[:free]:
                    self._settle_each(session, job, restarted=False)

    def _settle_each(self, session: Session, job: Job, restarted: bool) -> None:
        """One job's turn, in its own transactions: one job's trouble must not stop the queue."""
        try:
            if job.status == "queued":
                self._launch(session, job)
            else:
                self._check(session, job, restarted)
            session.commit()
        except Exception:
            session.rollback()
            log.exception("checking job %s failed", job.id)

    def _launch(self, session: Session, job: Job) -> None:
        """Record the intent (committed) before starting anything: an API that dies after this finds a
        "running" job and, through its run folder, whether its run started (`_check`), never a queued job
        whose run is already going."""
        job.status = transition(job.status, "running")
        job.started_at, job.pid = now(), None
        session.add(job)
        session.commit()
        self._spawn(session, job)

    def _spawn(self, session: Session, job: Job) -> None:
        run_dir = Path(job.run_dir)
        try:
            head = self._ray.head() if self._ray is not None else None
            env = job_environment(dict(os.environ), (run_dir / "telemetry.token").read_text().strip(),
                                  head.address if head else self.settings.ray_address)
            if head is not None:
                env |= auth_environment(head.token)
            proc = start_run(runtime_command(run_dir / "job.json", job.config["strategy"]["num_workers"],
                                             self.settings.local_ray), run_dir, env)
        except OSError as err:  # failing each tick would not make it start: the job fails, saying why
            job.status = transition(job.status, "failed")
            job.error_code, job.error_message = "run_failed", f"the run could not be started: {err}"
            job.finished_at = now()
            add_event(session, job, job.error_message, level="error")
            session.add(job)
            return
        self._children[job.id] = proc
        job.pid = proc.pid
        add_event(session, job, f"started: process {proc.pid}, log {run_dir / 'run.log'}")
        session.add(job)

    def _check(self, session: Session, job: Job, restarted: bool) -> None:
        proc = self._children.get(job.id)
        if proc is not None:
            code = proc.poll()
            if code is None:
                return
            del self._children[job.id]
            if code != REFUSED:
                self._finish(session, job, code)
                return
            job.pid = None  # another launch of this job has its folder (one from before an API restart)
        run_dir = Path(job.run_dir)
        claimed = run_pid(run_dir)  # read before the lock is tried: a run that claims the folder after it
        #                             holds the lock first, so it is never mistaken for an ended one
        if run_alive(run_dir) or (claimed is None and job.pid and _alive(job.pid, job.run_dir)):
            # running (or its launcher about to run it); a run from before `run.pid` existed has only its pid
            adopted = claimed or job.pid
            if adopted is not None and (restarted or adopted != job.pid):
                add_event(session, job, f"re-attached to process {adopted} after an API restart")
            job.pid = adopted
            session.add(job)
        elif claimed is None and job.pid is None:
            self._spawn(session, job)  # launching was recorded, and no run ever started: start it now
        else:
            self._finish(session, job, None)  # not our child and gone: only its files can tell

    def _finish(self, session: Session, job: Job, code: int | None) -> None:
        run_dir = Path(job.run_dir)
        # what the run measured but the API missed (down, or slow, as the run ended) is in its metrics file
        recovered = telemetry.recover(session=session, job=job, path=self._metrics_file(job),
                                      data_dir=self.settings.data_dir, learn=self)
        if recovered:
            add_event(session, job, f"{recovered} records of the run that never reached the API were read from "
                                    "its metrics file")
        result_file = run_dir / "output" / "result.json"
        if result_file.exists() and code in (0, None):
            # a diverged run writes NaN, which SQL JSON columns refuse: kept as null
            job.result = {**json.loads(result_file.read_text(), parse_constant=lambda _: None),
                          "result_files": (job.result or {}).get("result_files", [])}  # made by the API
            job.status = transition(job.status, "succeeded")
            add_event(session, job, "succeeded")
        else:
            reason = (f"the run exited with code {code}" if code is not None
                      else "the run's process is gone (the API restarted while it ran) and it left no result")
            end = self.logs(job, REASON_SEARCH_LINES)
            tail = end[-LOG_TAIL_LINES:]
            # the runtime's last word on why (one line), else how it ended; the log's tail is in the event
            said = next((line.removeprefix("error: ") for line in reversed(end) if line.startswith("error: ")), None)
            job.status = transition(job.status, "failed")
            job.error_code, job.error_message = "run_failed", f"{said} ({reason})" if said else reason
            add_event(session, job, f"{job.error_message}. Last log lines:\n" + "\n".join(tail), level="error")
        job.finished_at, job.pid = now(), None
        session.add(job)

    def cancel(self, session: Session, job: Job) -> None:
        with self._lock:
            # as it is now, not as it was read before the lock: the scheduler may have started it meanwhile
            session.refresh(job)
            if job.status in TERMINAL:
                raise AlreadyFinished(job.status)
            if job.status == "running":
                self._stop_run(job)
            job.status = transition(job.status, "cancelled")
            job.finished_at, job.pid = now(), None
            add_event(session, job, "cancelled by the user")
            session.add(job)
            session.commit()

    def _stop_run(self, job: Job) -> None:
        """End every process of the run: its process group asked first, then killed with what is left."""
        run_dir = Path(job.run_dir)
        group = run_pid(run_dir) or job.pid
        proc = self._children.pop(job.id, None)
        if group is None:
            return  # launching was recorded but nothing started
        try:
            os.killpg(group, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while (run_alive(run_dir) or _alive(group, job.run_dir)) and time.monotonic() < deadline:
                if proc is not None:
                    proc.poll()  # our child: reaped as it ends
                time.sleep(0.1)
            os.killpg(group, signal.SIGKILL)  # what outlived the run's main process (its workers, a stuck one)
        except ProcessLookupError:
            pass  # the whole group is gone
        if proc is not None:
            proc.wait(timeout=10)

    def reconcile(self) -> None:
        """After a restart: runs that live on are watched again, launches that never started are started,
        and the rest are settled from what the run left."""
        with self._lock, Session(self.engine) as session:
            for job in session.exec(select(Job).where(Job.status == "running")).all():
                self._settle_each(session, job, restarted=True)


def runtime_command(config_path: Path, workers: int, local_ray: bool) -> list[str]:
    """The runtime's command line: on Ray, or one plain process per worker under torchrun."""
    command = [sys.executable, "-m", "tunewright_jobs.run", "--config", str(config_path)]
    if local_ray:
        return command
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={workers}", *command[1:], "--no-ray"]


def start_run(command: list[str], run_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    """`command` under the launcher, in a process group of its own whose leader records itself in the folder."""
    with (run_dir / "run.log").open("ab") as log_file:
        return subprocess.Popen([sys.executable, str(LAUNCHER), str(run_dir), *command], stdout=log_file,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=run_dir)


def run_pid(run_dir: Path) -> int | None:
    """The process (and process group) that claimed the folder for its run, if one ever did."""
    try:
        return int((run_dir / PID_FILE).read_text())
    except (OSError, ValueError):
        return None


def run_alive(run_dir: Path) -> bool:
    """True while the folder's run lives: it holds the folder's lock until it ends."""
    return lock_held(str(run_dir / LOCK_FILE))
