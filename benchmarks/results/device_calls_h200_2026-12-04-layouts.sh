# The device call behind layouts_check_h200_2026-12-04.json (one H200, 2026-12-04; issue 32 item 4):
# Llama-1B full, micro-batch 8 x 2048 tokens, through Ray Train, checkpointing none / every block / every other
# block, beside the planner's predictions (not fitted on these runs). Here first: ../shared/device/pack-ray.sh.
# carry [".whl-ray"]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ray/*.whl && tar -xJf .whl-ray/ray-slim.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD/jobs:$PWD/operator || exit; export PYTHONUNBUFFERED=1; set -o pipefail; python3 benchmarks/layouts_check.py --out $OUT --cases llama-1b-full --steps 25 2>&1 | grep -v -i "warning\|shards" | tail -30; rm -rf $OUT/work
