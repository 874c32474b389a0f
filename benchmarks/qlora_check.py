"""QLoRA on one H200 through the product's own path (Ray Train): a 4-bit NF4 base against a bf16 base and against
CPU offload, tokens/s and peak memory, each beside the planner's prediction for the same layout.

Models are built from configs (random init). Llama-8B is saved in bf16 and quantized as the runtime loads it, as a
user's checkpoint would be. A 70B-shaped model is too large to save in bf16 on the GPU machine's disk (140 GB of 64):
it is built a block at a time on the GPU, quantized there, and saved pre-quantized (the bitsandbytes layout
transformers loads, as a published `*-bnb-4bit` checkpoint is); its bf16 LoRA and CPU offload cannot run on that
machine at all (the weights alone are 141 GB; pinned host memory is 128 GiB), and the planner's words say so.

  python benchmarks/qlora_check.py --out benchmarks/results/qlora_check_h200_<date>.json --cases 8b
  python benchmarks/qlora_check.py --out ... --cases 70b
  python benchmarks/qlora_check.py --smoke --out /tmp/q.json      # CPU: tiny shapes, the same code paths
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_runs import (  # noqa: E402
    MODELS,
    PEAK_FLOPS,
    build_model,
    device_name,
    measured_steps,
    one_gpu_strategy,
    planner_gpu,
    run_on_ray,
    write_dataset,
)

from tunewright_core.planner import calibration  # noqa: E402
from tunewright_core.planner.estimate import Layout, Workload, estimate  # noqa: E402
from tunewright_core.planner.hardware import GIB  # noqa: E402
from tunewright_core.planner.models import CATALOG, ModelProfile, hf_config  # noqa: E402
from tunewright_core.planner.search import plan  # noqa: E402
from tunewright_fit.calibration_fit import measured_pool  # noqa: E402

WARMUP_STEPS = 4
PROFILE_70B = CATALOG["meta-llama/Llama-3.1-70B"]
SMOKE_70B = ModelProfile("llama-70b-smoke", 2, 128, 4, 2, 256, 512, False)


class Case(NamedTuple):
    name: str
    model: str  # "llama-8b" or "llama-70b"
    quantization: str  # none | nf4
    micro_batch: int
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    compile: str = "auto"
    seq_len: int = 1024
    steps: int = 12


CASES = {
    "8b": [  # issue 35's Llama-8B LoRA case: r16 all-linear, seq 1024, micro-batch 4
        Case("8b-lora-bf16", "llama-8b", "none", 4),
        Case("8b-qlora", "llama-8b", "nf4", 4),  # auto compiles the 4-bit blocks on a GPU
        Case("8b-qlora-eager", "llama-8b", "nf4", 4, compile="off"),  # what compiling them buys
        Case("8b-qlora-mb8-ac", "llama-8b", "nf4", 8, activation_checkpointing=True),
        Case("8b-lora-bf16-offload", "llama-8b", "none", 4, cpu_offload=True, steps=8),
    ],
    "70b": [
        Case("70b-qlora-mb4-ac", "llama-70b", "nf4", 4, activation_checkpointing=True, steps=8),
    ],
}


def profile_of(model: str, smoke: bool) -> ModelProfile:
    if model == "llama-70b":
        return SMOKE_70B if smoke else PROFILE_70B
    from gpu_runs import SMOKE_MODELS
    return (SMOKE_MODELS if smoke else MODELS)[model][0]


def build_four_bit(profile: ModelProfile, out: Path, device: str) -> int:
    """A Llama of `profile`'s shape, random init, its blocks' linear weights quantized to NF4 (double quantization)
    one at a time on `device` and saved in bitsandbytes' serialized layout; embeddings, head and norms in bf16."""
    import bitsandbytes as bnb
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from tunewright_jobs.tiny import build_tokenizer

    fields = hf_config(profile)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, max_position_embeddings=8192,
                                  rope_theta=500000.0)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files, params = [0], 0

    def flush() -> None:
        name = f"model-{files[0]:05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
        shard.clear()
        files[0] += 1

    size = 0
    for module_name, module in skeleton.named_modules():
        for name, p in module.named_parameters(recurse=False):
            key, params = f"{module_name}.{name}", params + p.numel()
            if isinstance(module, torch.nn.Linear) and ".layers." in module_name:
                weight = torch.randn(p.shape, device=device, dtype=torch.bfloat16) * 0.02
                quantized = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4",
                                              compress_statistics=True).to(device)
                tensors = {key: quantized.data, **{f"{key}.{k}": v for k, v in
                                                  quantized.quant_state.as_dict(packed=True).items()}}
            elif "norm" in key:
                tensors = {key: torch.ones(p.shape, dtype=torch.bfloat16)}
            else:
                tensors = {key: torch.randn(p.shape, device=device, dtype=torch.bfloat16) * 0.02}
            for k, v in tensors.items():
                shard[k] = v.contiguous().cpu()
                size += v.numel() * v.element_size()
            if size > 4 * GIB:
                flush()
                size = 0
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    saved = config.to_dict()
    saved["quantization_config"] = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16).to_dict()
    saved["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    build_tokenizer(out, chat_template=None)
    return params


def predicted(case: Case, profile: ModelProfile) -> dict:
    """The planner's step time and peak for this very layout, and the layout it would choose itself."""
    cal, gpu = calibration.load()[0], planner_gpu()
    method = "qlora" if case.quantization == "nf4" else "lora"
    w = Workload(profile, method, case.seq_len, case.micro_batch, steps=1, recompute="auto")
    layout = Layout("single", 1, 1, case.micro_batch, 1, case.activation_checkpointing, cpu_offload=case.cpu_offload)
    e = estimate(w, layout, measured_pool(gpu, 1), cal)
    row = {"step_seconds": e.step_seconds, "peak_memory_gib": e.peak_memory_bytes / GIB,
           "host_memory_gib": e.host_memory_bytes / GIB, "tokens_per_second": w.tokens_per_step / e.step_seconds}
    try:
        chosen = plan(w, measured_pool(gpu, 1), cal)
        row["planner_would_choose"] = chosen.explanation.split(":")[0]
    except ValueError as err:
        row["planner_would_choose"] = f"no plan: {err}"
    return row


def run_case(case: Case, model_dir: Path, data: Path, work: Path, smoke: bool) -> dict:
    out = work / case.name
    config = {
        "name": case.name, "output_dir": str(out), "model": {"source": str(model_dir)},
        "method": {"type": "lora", "lora": {"r": 16, "alpha": 32, "dropout": 0.0,
                                            "quantization": case.quantization}},
        "dataset": {"train": str(data), "format": "text"},
        "hyperparameters": {"max_steps": case.steps, "learning_rate": 1e-4, "lr_schedule": "constant",
                            "seq_len": 128 if smoke else case.seq_len, "warmup_ratio": 0.0, "seed": 0,
                            "global_batch_size": case.micro_batch},
        "strategy": one_gpu_strategy(case.micro_batch, case.activation_checkpointing, case.cpu_offload, smoke),
        "kernels": {"compile": case.compile},
        "checkpoint": {"final": False},
        "metrics": {"log_every_steps": 1, "profile": {"enabled": False}},
    }
    row, records, stderr = run_on_ray(config, out, timeout=540)
    if "error" in row:
        return row
    steps = [r for r in records if r["event"] == "step"]
    measured = steps[WARMUP_STEPS:]
    start = next(r for r in records if r["event"] == "start")
    kernels = next((line.split("kernels: ", 1)[1] for line in stderr.splitlines() if "kernels: " in line), "")
    return row | {
        **measured_steps(measured),
        "peak_memory_reserved_gib": max((r.get("peak_memory_reserved_gib") or 0.0) for r in measured),
        "losses": [r["loss"] for r in steps], "steps_measured": len(measured), "kernels": kernels,
        "parameters": start.get("parameters"), "trainable_parameters": start.get("trainable_parameters"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/tunewright-qlora"))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--only", nargs="+", help="case names within --cases")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code paths, not the speed")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / "data.jsonl"
    write_dataset(data, 400, 3000 if not args.smoke else 200)
    device = "cpu" if args.smoke else "cuda"
    rows, built = [], {}
    for group in args.cases:
        for case in CASES[group]:
            if args.only and case.name not in args.only:
                continue
            profile = profile_of(case.model, args.smoke)
            if case.model not in built:
                started = time.time()
                path = args.work / case.model
                if case.model == "llama-70b":
                    params = build_four_bit(profile, path, device)
                else:
                    params = build_model(profile, (MODELS[case.model][1] if not args.smoke else
                                                   {"max_position_embeddings": 512}), path)
                built[case.model] = path
                print(f"built {case.model}: {params / 1e9:.2f}B parameters in {time.time() - started:.0f} s",
                      flush=True)
            row = {"case": case._asdict(), "predicted": predicted(case, profile),
                   **run_case(case, built[case.model], data, args.work, args.smoke)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"})[:1500], flush=True)
    result = {"gpu": device_name(args.smoke), "time": time.strftime("%Y-%m-%d %H:%M"),
              "peak_flops": PEAK_FLOPS, "runs": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'case':28} {'tok/s':>9} {'pred':>9} {'peak GiB':>9} {'pred':>7}")
    for row in rows:
        p = row["predicted"]
        print(f"{row['case']['name']:28} {row.get('tokens_per_second', 0):9.0f} {p['tokens_per_second']:9.0f} "
              f"{row.get('peak_memory_gib', 0):9.1f} {p['peak_memory_gib']:7.1f} {row.get('error', '')[:60]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
