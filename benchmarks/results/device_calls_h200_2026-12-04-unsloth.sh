# tunewright against Unsloth, HF and HF + Liger on one H200 (issue 35, target 1), ready but NOT RUN: no GPU machine
# was lent on 2026-12-04. Carry [".whl-unsloth"]: Unsloth 2026.10.9, unsloth_zoo, trl 1.15, datasets and a
# bitsandbytes slimmed to CUDA 13 (the workplace's Unsloth pack; ~40 MiB), plus the .whl-ray wheels but Ray and
# bitsandbytes (pydantic and its kin: tunewright_core needs them) and liger_kernel-0.8.5 (not in the GPU image);
# 43 MiB in all, so .whl-ray cannot travel beside it (64 MiB). One call a case (each within 600 s); not yet run:
# on 2026-12-05 the machine went before it, and none was lent in the session after. The second call is the same
# with `--cases llama8b-lora --systems tunewright tw-fp8 unsloth-no-ckpt`; both write the profiled last steps of
# tunewright's run, summarized by kind of kernel (where the 8B LoRA step's ~85 ms outside the planner's matrix
# products goes: no profile of it exists yet). `unsloth-no-ckpt` (added 2026-12-07) is Unsloth without gradient
# checkpointing, the like-for-like bar; `unsloth` (its defaults, offloaded checkpointing) ran on one H100 on
# 2026-12-05 (device_calls_h100_2026-12-05.sh: 53,049 tok/s at 4.8 GiB).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-unsloth/*.whl && tar -xJf .whl-unsloth/bnb-slim.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site || exit
export HF_HUB_OFFLINE=1
mkdir -p $OUT
python3 benchmarks/vs_hf.py --out $OUT/vs_unsloth.json --cases llama1b-lora --systems tunewright tw-fp8 unsloth-no-ckpt unsloth hf+liger --trace $OUT/traces 2>&1 | tail -30
for t in $OUT/traces/*/*.json.gz; do python3 benchmarks/trace_summary.py $t --top 15; done 2>&1 | tail -60
