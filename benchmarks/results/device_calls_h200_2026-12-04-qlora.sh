# QLoRA on the H200 (issue 36). The call below ran on 2026-12-05 (qlora_check_h200_2026-12-05-8b.json; its `8b-qlora`
# row was eager then, `8b-qlora-compiled` compiled). NOT RUN yet, no machine lent after it: the second call.
# Carry [".whl-ray"]: Ray packed by ../shared/device/pack-ray.sh, plus bitsandbytes slimmed to the GPU image's CUDA:
#   pip download --no-deps 'bitsandbytes==0.50.2'; unzip the wheel; delete libbitsandbytes_* but cuda130 and cpu
#   (torch 2.11+cu130 there); tar -cJf .whl-ray/bitsandbytes-slim.tar.xz bitsandbytes bitsandbytes-*.dist-info
# (3.5 MB). Second call: the same prefix, then `--cases 70b`, `--cases 8b --only 8b-qlora-mb8-ac 8b-lora-bf16-offload`
# (held out of qlora_fit), and `pytest -m gpu tests/jobs/test_gpu.py -k 'qlora or bf16_state or fp8'`.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ray/*.whl && tar -xJf .whl-ray/ray-slim.tar.xz -C /tmp/site && tar -xJf .whl-ray/bitsandbytes-slim.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD/jobs:$PWD/core:$PWD/fitting || exit
export HF_HUB_OFFLINE=1
python3 -c "import bitsandbytes, torch; print(bitsandbytes.__version__, torch.__version__)"
mkdir -p $OUT
python3 benchmarks/qlora_check.py --cases 8b --only 8b-lora-bf16 8b-qlora 8b-qlora-compiled 8b-qlora-mb8-ac --out $OUT/qlora_8b.json 2>&1 | grep -v "Warning\|warn(" | tail -25
