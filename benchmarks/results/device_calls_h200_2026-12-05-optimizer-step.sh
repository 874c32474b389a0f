# Bf16AdamW's fused Triton kernel against its eager update and torch's fused fp32 AdamW, on Llama-8B's parameter
# tensors on one H200 (issue 35, target 3), ready but NOT RUN: no GPU machine was lent on 2026-12-05. Carry
# [".whl-ray"] (for pydantic, which the tests' conftest needs; the benchmark itself needs torch and Triton alone);
# ~64 GB of GPU memory for the bf16 rows, ~128 GB for the fp32 one. Then the GPU's own run of the kernel's tests
# (they take the GPU when there is one).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ray/*.whl && tar -xJf .whl-ray/ray-slim.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD/jobs:$PWD/core:$PWD/fitting || exit
export HF_HUB_OFFLINE=1
mkdir -p $OUT
python3 benchmarks/optimizer_step_check.py --model llama-8b --out $OUT/optimizer_step_h200.json 2>&1 | tail -6
python3 -m pytest -q -p no:cacheprovider tests/jobs/test_bf16_fused.py 2>&1 | tail -3
