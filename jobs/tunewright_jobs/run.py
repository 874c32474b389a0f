"""Command line: `python -m tunewright_jobs.run --config job.json [--no-ray]`.

With Ray (the default) the run is a Ray Train `TorchTrainer`: workers and GPUs from the strategy,
checkpoints in `checkpoint.storage` under the job's name (a restarted run with the same name resumes
from the newest one), joining the Ray cluster at RAY_ADDRESS or starting one of its own (never one it finds on the host).
With `--no-ray` it trains in this process, or in each process of a `torchrun` launch.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import traceback
from collections.abc import Mapping
from pathlib import Path

import tunewright_core.records as records  # where core is, for Ray's local workers
from tunewright_jobs.config import ConfigError, JobConfig
from tunewright_jobs.data import DatasetError
from tunewright_jobs.remote_data import localize_datasets

log = logging.getLogger("tunewright_jobs")


def train_without_ray(cfg: JobConfig) -> dict:
    from tunewright_jobs.checkpoint import DirectoryCheckpointStore
    from tunewright_jobs.parallel import init_dist
    from tunewright_jobs.train import Runtime, train

    dist = init_dist(cfg)
    store = DirectoryCheckpointStore(cfg.checkpoint_storage, cfg.name, cfg.checkpoint.keep_last, dist)
    try:
        result = train(cfg, Runtime(dist, store))
        # every rank past its last collective before any tears its group down: a gloo rank once ended on
        # "terminate called without an active exception" at the end of a two-rank run (its peer gone first)
        dist.barrier()
        return result
    finally:
        import torch.distributed

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _ray_worker(loop_config: dict) -> None:
    import ray.train.torch

    from tunewright_jobs.checkpoint import RayCheckpointStore
    from tunewright_jobs.parallel import init_dist
    from tunewright_jobs.train import Runtime, train

    os.environ.update(loop_config.get("environment", {}))
    _configure_logging()
    cfg = JobConfig.from_json(loop_config["config"])
    dist = init_dist(cfg, device=ray.train.torch.get_device())
    train(cfg, Runtime(dist, RayCheckpointStore(loop_config["storage"], cfg.name, dist)))


def connect_ray() -> None:
    """Join the Ray cluster this run was given (RAY_ADDRESS, e.g. a KubeRay head), or start one of its own.

    Never Ray's discovery (address "auto" or None): it joins whatever cluster runs on the host, such as
    another checkout's, whose workers run other code and lack this job's environment. A given cluster that
    cannot be reached fails the run rather than quietly training somewhere else.
    """
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    log.info("no RAY_ADDRESS: starting a Ray cluster for this run alone")
    # Its own session directory (Ray's default, /tmp/ray, is shared by every Ray on the host), removed at
    # exit after Ray's own shutdown (atexit runs in reverse order of registration).
    temp_dir = tempfile.mkdtemp(prefix="tunewright-ray-")
    atexit.register(shutil.rmtree, temp_dir, ignore_errors=True)
    # Local workers import this package, and core's records, from where the driver found them (installed or not).
    source_roots = [str(Path(module.__file__).resolve().parent.parent) for module in (sys.modules[__package__],
                                                                                       records)]
    path = os.pathsep.join(p for p in (*dict.fromkeys(source_roots), os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", runtime_env={"env_vars": {"PYTHONPATH": path}}, include_dashboard=False,
             _temp_dir=temp_dir)


def own_ray_auth(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that give the Ray a run starts a token of its own: its GCS listens on every interface of
    the host, and whoever reaches it runs code as this user. Ray's processes inherit them from this one. A
    token (or an auth mode) already set is kept."""
    return {"RAY_AUTH_MODE": environ.get("RAY_AUTH_MODE") or "token",
            "RAY_AUTH_TOKEN": environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32)}


def secure_own_ray(no_ray: bool) -> None:
    """A run that will start its own Ray gives it a token (`own_ray_auth`). Ray reads the variables once, when it
    is imported: set only before that (this process's entry point); a process that imported Ray already keeps
    what it read, or its own driver could not join the Ray it starts."""
    if not no_ray and not os.environ.get("RAY_ADDRESS", "").strip() and "ray" not in sys.modules:
        os.environ.update(own_ray_auth(os.environ))


def storage_uri(storage: str) -> str:
    return storage if "://" in storage else str(Path(storage).expanduser().resolve())


def train_with_ray(cfg: JobConfig, max_failures: int) -> dict:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from tunewright_jobs.train import preflight

    preflight(cfg)  # bad data fails here, before any worker or GPU is requested
    connect_ray()
    st = cfg.strategy
    storage = storage_uri(cfg.checkpoint_storage)  # resolved here: a worker's working directory differs
    trainer = TorchTrainer(
        _ray_worker,
        # a joined cluster's workers have its environment, not this driver's: the job's own settings (its
        # telemetry token above all) go with the loop's config (a runtime_env would make Ray start fresh
        # worker processes for each job rather than use those it keeps ready)
        train_loop_config={"config": cfg.to_json(), "storage": storage,
                           "environment": {k: v for k, v in os.environ.items() if k.startswith("TUNEWRIGHT_")}},
        scaling_config=ScalingConfig(num_workers=st.num_workers, use_gpu=st.use_gpu),
        torch_config=TorchConfig(backend="nccl" if st.use_gpu else "gloo"),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=storage,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep_last),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    trainer.fit()
    # Rank 0 wrote it; output_dir must be storage the driver sees (on a cluster: a shared volume).
    return json.loads((Path(cfg.output_dir) / "result.json").read_text())


# What a model that cannot be loaded looks like from transformers and huggingface_hub, and what to do about it.
MODEL_SOURCE_FAILURES = (
    (("couldn't connect to", "offline mode", "failed to resolve", "max retries exceeded", "name resolution"),
     "model.source: {source} cannot be downloaded: the Hugging Face Hub is not reachable from here. Download it "
     "where it is, then give its folder (or a volume: pvc://claim/path)"),
    (("repo id must", "is not a local folder and is not a valid model identifier", "repository not found",
      "not a valid model identifier"),
     "model.source: {source} is neither a folder here nor a model on the Hugging Face Hub"),
    (("gated repo", "401 client error", "access to model"),
     "model.source: {source} needs a Hugging Face token with access to it (HF_TOKEN)"),
)


def say_error(message: str) -> None:
    """The run's last word, `error: ...`, in one write: ranks sharing a stderr (torchrun) that each print theirs
    would otherwise interleave the line and its newline into one line holding both."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def failure_line(err: BaseException, source: str) -> str:
    """One line a user can act on: the innermost cause (Ray wraps a worker's error twice), the model source's
    known failures said plainly, anything else as its type and first line."""
    while True:
        inner = getattr(err, "cause", None) or err.__cause__  # RayTaskError keeps the worker's in .cause
        if not isinstance(inner, BaseException) or inner is err:
            break
        err = inner
    lines = [line for line in str(err).splitlines() if line.strip()]
    text = " ".join(lines).lower()
    for needles, message in MODEL_SOURCE_FAILURES:
        if any(needle in text for needle in needles):
            return message.format(source=source)
    return f"{type(err).__name__}: {lines[0][:500] if lines else 'no message'}"


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher() -> None:
    """Under torchrun each worker runs in a session of its own, which a SIGKILL of the launcher's process
    group (the local backend's last resort when a run ignores SIGTERM, or anyone's) never reaches: ask the
    kernel to kill this worker when its launcher dies, instead of leaving it training for nobody. Linux
    only; a launcher that died before the request took is caught by the parent having changed."""
    if not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not granted (a seccomp profile, say): the run behaves as before
    if os.getppid() != launcher:
        os._exit(1)


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tunewright_jobs.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="job config (JSON)")
    parser.add_argument("--no-ray", action="store_true", help="train in this process (or under torchrun)")
    parser.add_argument("--max-failures", type=int, default=0,
                        help="Ray: worker-group restarts from the newest checkpoint before giving up")
    args = parser.parse_args(argv)
    secure_own_ray(args.no_ray)
    _configure_logging()
    if args.no_ray and "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_launcher()
    try:
        cfg = JobConfig.load(args.config)
    except (ConfigError, OSError) as err:
        say_error(f"{args.config}: {err}")
        return 2
    try:
        cfg = localize_datasets(cfg)
        result = train_without_ray(cfg) if args.no_ray else train_with_ray(cfg, args.max_failures)
    except (DatasetError, ConfigError) as err:
        say_error(str(err))
        return 2
    except Exception as err:  # the traceback for the log; the last line, for the job's error, says it plainly
        traceback.print_exc()
        say_error(failure_line(err, cfg.model.source))
        return 1
    if result:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
