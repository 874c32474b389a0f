# bf16 optimizer state on the H200 (issue 35, target 3), ready but NOT RUN: no GPU machine was lent on 2026-12-04.
# Carry [".whl-ray"] (Ray packed by ../shared/device/pack-ray.sh). Two calls: --cases quality (two 500-step
# Llama-1B runs, ~5 min), then --cases 8b (Llama-8B full: fp32 masters offloaded against bf16 state on the GPU).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ray/*.whl && tar -xJf .whl-ray/ray-slim.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD/jobs:$PWD/core:$PWD/fitting || exit
export HF_HUB_OFFLINE=1
mkdir -p $OUT
python3 benchmarks/light_state_check.py --cases quality --out $OUT/light_state_quality.json 2>&1 | grep -v "Warning\|warn(" | tail -8
