# FP8 products against bf16 on the H200 (issue 35, target 2), ready but NOT RUN: no GPU machine was lent on
# 2026-12-04 or 2026-12-05. Carry [".whl-ray"] (Ray packed by the workplace's Ray pack). One call a case: --cases
# 8b-lora (200 steps of each precision, blocks compiled as by default, ~2 min), then 3b-full (with the export loaded
# back in bf16), then 8b-lora-eager (both precisions with compile off: what compiling is worth to FP8's casts) and
# 8b-lora-recompute (both with kernels.recompute on: the other cases set it off for both, like for like). Also
# run `pytest -m gpu tests/jobs/test_gpu.py` with the bitsandbytes pack of the QLoRA call extracted too (its QLoRA
# test needs it).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ray/*.whl && tar -xJf .whl-ray/ray-slim.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD/jobs:$PWD/core:$PWD/fitting || exit
export HF_HUB_OFFLINE=1
mkdir -p $OUT
python3 benchmarks/fp8_check.py --cases 8b-lora --out $OUT/fp8_8b_lora.json 2>&1 | grep -v "Warning\|warn(" | tail -6
