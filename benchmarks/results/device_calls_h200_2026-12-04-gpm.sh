# The device calls behind gpm_window_check_h200_2026-12-04.json (one H200, 2026-12-04; issue 33 item 11).
# Here, before the calls: ../shared/device/pack-ray.sh (ray 2.x into .whl-ray/);
#   mkdir -p .device/head && git archive HEAD jobs | tar -x -C .device/head      # the runtime before the fix
#   mkdir -p .device/after && cp -r jobs .device/after/                            # the runtime with it
# Each call: carry [".whl-ray", ".device"]. The first call (same command without the per-window pairs and the
# copies below) read the same: before 0.25 vs 0.60 with 235 zeros of 397 windows, after 0.617 vs 0.617.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ray/*.whl && tar -xJf .whl-ray/ray-slim.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD/jobs:$PWD/operator || exit; export PYTHONUNBUFFERED=1; set -o pipefail; python3 benchmarks/gpm_window_check.py --out $OUT --before .device/head/jobs --after .device/after/jobs --steps 400 2>&1 | tee $OUT/log.txt | grep -v -i "warning\|shards"; rm -f $OUT/reference-sweep-0.1.jsonl $OUT/reference-sweep-0.25.jsonl $OUT/reference-sweep-1.0.jsonl; cp $OUT/work/after/metrics.jsonl $OUT/after-metrics.jsonl; cp $OUT/work/before/metrics.jsonl $OUT/before-metrics.jsonl; cp $OUT/work/after/reference.jsonl $OUT/after-reference.jsonl; rm -rf $OUT/work
