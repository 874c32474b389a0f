#!/usr/bin/env bash
# The device calls of 2026-12-03 (second session) on one lent H200: `single` without FSDP2 (parallel.MasterWeights)
# against the runtime before it. Run as `bash benchmarks/results/device_calls_h200_2026-12-03-masters.sh CALL` from
# the repository root with `.whl` (pydantic, liger-kernel) and `.device/head` carried. `.device/head` is
# `git archive 5bb9776 jobs operator benchmarks/{gpu_runs,vs_hf,hf_baseline}.py`: the runtime before the change
# (every strategy on FSDP2), run in the same invocation as the new one.
# Ran, in this order, on one machine held through four calls: gpt2 (12:10 UTC; pytest 5 passed), llama (12:17),
# trace_cal (12:21), rest (12:29); then, on a fresh machine, verify (12:40; pytest 2 passed). "New" in the first
# four was a variant that kept the bf16 copies to the end of the step; the committed runtime, which verify ran,
# frees each copy once the step's last backward has folded its gradient (as FSDP2 reshards).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -c "import pydantic, liger_kernel" || exit 3
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt"
date -u +%FT%TZ >> "$OUT/started.txt"
WORK=/tmp/tunewright-vs-hf
head_run() {  # CASE TIMEOUT N: the runtime before, tunewright alone
  timeout "$2" python3 .device/head/benchmarks/vs_hf.py --out "$OUT/vs_hf_head.json" --work $WORK --cases "$1" \
    --systems tunewright >> "$OUT/vs_hf_head.log" 2>&1
}
new_run() {  # CASE TIMEOUT SYSTEMS...
  local case=$1 limit=$2; shift 2
  timeout "$limit" python3 benchmarks/vs_hf.py --out "$OUT/vs_hf.json" --work $WORK --cases "$case" \
    --systems "$@" >> "$OUT/vs_hf.log" 2>&1
}

case "$1" in
gpt2)  # the GPU tests of the runtime; GPT-2 full: before and after alternated (its steps drift run to run), HF + Liger
  timeout 170 python3 -m pytest -q -m gpu tests/jobs/test_gpu.py -k "full_on_one_gpu or fast_paths or lora_bf16 or cpu_offload or mesh_of_one" \
    -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
  tail -3 "$OUT/pytest_gpu.log"
  new_run gpt2-full 150 tunewright hf+liger
  for i in 1 2; do head_run gpt2-full 75; new_run gpt2-full 75 tunewright; done
  head_run gpt2-full 75
  grep -h -E "^(case|gpt2)" "$OUT/vs_hf_head.log" "$OUT/vs_hf.log"
  ;;
llama)  # Llama-1B full: before, after, HF + Liger; the LoRA rows after, with HF + Liger
  head_run llama1b-full 130
  new_run llama1b-full 250 tunewright hf+liger
  new_run llama1b-lora 160 tunewright hf+liger
  grep -h -E "^(case|llama)" "$OUT/vs_hf_head.log" "$OUT/vs_hf.log"
  ;;
rest)  # LoRA on variable-length rows and Llama-8B LoRA, after, with HF + Liger
  new_run llama1b-lora-variable 200 tunewright hf+liger
  new_run llama8b-lora 300 tunewright hf+liger
  grep -h -E "^(case|llama)" "$OUT/vs_hf.log"
  ;;
trace_cal)  # profiler traces of the new runtime; the calibration's fit-set runs without offload
  for c in llama1b-full gpt2-full; do
    timeout 130 python3 benchmarks/vs_hf.py --out "$OUT/vs_hf_trace.json" --work $WORK --cases $c --systems tunewright \
      --trace /tmp/traces >> "$OUT/trace.log" 2>&1
  done
  tar -czf "$OUT/traces.tar.gz" -C /tmp traces
  timeout 330 python3 benchmarks/gpu_runs.py --matrix calibration --steps 12 --out "$OUT/cal" --work /tmp/cal \
    --only 'gpt2-124m*' llama-1b-full-single-1gpu-mb8 llama-1b-lora-single-1gpu-mb8 > "$OUT/cal.log" 2>&1
  ;;
verify)  # the committed runtime: its GPU tests, the end-of-backward peak of full fine-tuning, GPT-2's speed
  timeout 70 python3 -m pytest -q -m gpu tests/jobs/test_gpu.py -k "mesh_of_one or full_on_one_gpu" -p no:cacheprovider \
    > "$OUT/pytest_gpu.log" 2>&1
  timeout 75 python3 benchmarks/gpu_runs.py --matrix calibration --steps 12 --out "$OUT/cal" --work /tmp/cal \
    --only llama-1b-full-single-1gpu-mb8-ac > "$OUT/cal.log" 2>&1
  timeout 60 python3 benchmarks/vs_hf.py --out "$OUT/vs_hf.json" --work /tmp/w --cases gpt2-full --systems tunewright \
    > "$OUT/vs_hf.log" 2>&1
  ;;
*) echo "unknown call $1"; exit 2 ;;
esac
