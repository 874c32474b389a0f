# The device calls behind vs_hf invocations 5-6, gpu_calibration_h200.json and fused_loss_kernels_h200.json
# (2026-12-02, one lent H200 held through the four calls, 15:31-15:57 UTC). Each call ran setup, then its lines.
# setup:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
#   python3 -c "import pydantic, liger_kernel" || exit 3
#   nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/gpu.txt
#   date -u +%FT%TZ > $OUT/started.txt
# call 1:
timeout 90 python3 benchmarks/fused_loss_kernels.py --out $OUT/fused_loss_kernels_h200.json > $OUT/fused.log 2>&1
timeout 400 python3 benchmarks/vs_hf.py --out $OUT/vs_hf.json --cases gpt2-full llama1b-full llama1b-lora llama1b-lora-variable --systems tunewright hf+liger > $OUT/vs_hf.log 2>&1
python3 benchmarks/gpu_runs.py --matrix calibration --steps 12 --out $OUT/cal --work /tmp/cal --only llama-1b-lora-single-1gpu-mb8-var llama-1b-full-single-1gpu-mb8-var > $OUT/cal.log 2>&1
# call 2:
python3 benchmarks/gpu_runs.py --matrix calibration --steps 12 --out $OUT/cal --work /tmp/cal --only 'gpt2-124m*' llama-1b-full-single-1gpu-mb8 llama-1b-lora-single-1gpu-mb8 llama-1b-full-single-1gpu-mb2 llama-1b-full-single-1gpu-mb8-ac llama-1b-lora-single-1gpu-mb4-ac qwen-0.5b-full-single-1gpu-mb8 > $OUT/cal.log 2>&1
# call 3:
timeout 250 python3 benchmarks/vs_hf.py --out $OUT/vs_hf.json --cases llama8b-lora --systems tunewright hf+liger > $OUT/vs_hf.log 2>&1
python3 benchmarks/gpu_runs.py --matrix calibration --steps 12 --out $OUT/cal --work /tmp/cal --only llama-3b-lora-single-1gpu-mb4 llama-3b-full-single-1gpu-mb2 qwen-0.5b-lora-single-1gpu-mb4-ac > $OUT/cal.log 2>&1
timeout 110 python3 -m pytest -q -m gpu tests/jobs/test_gpu.py -k "full_on_one_gpu or fast_paths or lora_bf16" -p no:cacheprovider > $OUT/pytest_gpu.log 2>&1
# call 4:
timeout 380 python3 benchmarks/gpu_runs.py --matrix calibration --steps 12 --out $OUT/cal --work /tmp/cal --only llama-3b-full-single-1gpu-mb4-ac llama-3b-lora-single-1gpu-mb8-ac qwen-0.5b-full-single-1gpu-mb8-var llama-1b-full-single-1gpu-mb8-offload
# then: vs_hf JSONs merged into vs_hf_h200.json (rows replaced per case and system, invocations kept); the four
# gpu_calibration.json files into gpu_calibration_h200.json in the matrix's order; calibration_fit fit and report.
