# One H100 80GB HBM3 (nvidia-h100-x1; two earlier starts failed, 271 s of device time), 2026-12-07: five calls on one
# warm machine, 1,500 s in all. Calls 1-2 carry [".whl-ray"] (Ray and bitsandbytes, see
# device_calls_h200_2026-12-04-qlora.sh), calls 3-5 [".whl-unsloth"] (see device_calls_h200_2026-12-04-unsloth.sh).
RAY='python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ray/*.whl && tar -xJf .whl-ray/ray-slim.tar.xz -C /tmp/site && tar -xJf .whl-ray/bitsandbytes-slim.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD/jobs:$PWD/core:$PWD/fitting'
UNSLOTH='python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-unsloth/*.whl && tar -xJf .whl-unsloth/bnb-slim.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site'
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# 1 (243 s): qlora_check_h100_2026-12-07-70b.json (70B-shaped QLoRA: built 4-bit in 61 s, 1,301 tok/s, predicted
#   1,320; 46.7 GiB, predicted 47.8) and the QLoRA GPU test (pytest_gpu_h100_2026-12-07.log, first part: 1 passed).
eval "$RAY" || exit
timeout 440 python3 benchmarks/qlora_check.py --cases 70b --out $OUT/qlora_70b.json --work /tmp/q70; rm -rf /tmp/q70
timeout 130 python3 -m pytest -q -m gpu tests/jobs/test_gpu.py -k "qlora" -p no:cacheprovider
# 2 (373 s): qlora_check_h100_2026-12-07-8b-heldout.json and dpo_check_h100_2026-12-07-lora.json
timeout 300 python3 benchmarks/qlora_check.py --cases 8b --only 8b-qlora-mb8-ac 8b-lora-bf16-offload \
  --out $OUT/qlora_8b_heldout.json --work /tmp/q8; rm -rf /tmp/q8
timeout 240 python3 benchmarks/dpo_check.py --out $OUT --steps 20 --model llama-1b --seq-len 1024 --runs sft-lora dpo-lora
# 3 (204 s): vs_unsloth_h100_2026-12-07-llama1b.json, traces/llama1b-lora--tunewright-h100-2026-12-07.json.gz
eval "$UNSLOTH" || exit
timeout 470 python3 benchmarks/vs_hf.py --out $OUT/vs_unsloth.json --cases llama1b-lora \
  --systems tunewright unsloth-no-ckpt unsloth --trace $OUT/traces
for t in $OUT/traces/*/*.json.gz; do python3 benchmarks/trace_summary.py $t --top 12; done
# 4 (178 s): vs_unsloth_h100_2026-12-07-llama8b.json
timeout 470 python3 benchmarks/vs_hf.py --out $OUT/vs_unsloth_8b.json --cases llama8b-lora \
  --systems tunewright unsloth-no-ckpt tw-fp8
# 5 (94 s): host_link_h100_2026-12-07.json (1 GiB copies, 5 each: pinned and pageable, each direction; a host
#   AdamW-like add) and pytest_gpu_h100_2026-12-07.log's second part (dpo, bf16_state, fp8: 3 passed)
python3 -c "
import torch,time,json
n=1<<30; h=torch.empty(n,dtype=torch.uint8).pin_memory(); d=torch.empty(n,dtype=torch.uint8,device='cuda'); p=torch.empty(n,dtype=torch.uint8)
out={}
for name,f in [('h2d_pinned',lambda: d.copy_(h,non_blocking=True)),('d2h_pinned',lambda: h.copy_(d,non_blocking=True)),('h2d_pageable',lambda: d.copy_(p)),('d2h_pageable',lambda: p.copy_(d))]:
  f(); torch.cuda.synchronize(); t=time.perf_counter()
  for _ in range(5): f()
  torch.cuda.synchronize(); out[name]=5*n/(time.perf_counter()-t)/1e9
x=torch.empty(1<<28,dtype=torch.float32).pin_memory(); y=torch.empty(1<<28); t=time.perf_counter()
for _ in range(5): y.add_(x, alpha=0.5)
out['host_add_GBps']=5*3*4*(1<<28)/(time.perf_counter()-t)/1e9
print(json.dumps(out))"
timeout 230 python3 -m pytest -q -m gpu tests/jobs/test_gpu.py -k "dpo or bf16_state or fp8" -p no:cacheprovider
# 6 (73 s, later; carry [".whl-ray"]): pytest_gpu_h100_2026-12-07-dpo-offload.log: full DPO with CPU offload on one
#   GPU ran (its reference now stored in bf16); its first loss 0.7035 against log 2 failed the 1e-3 bound written
#   first. 7 (39 s): the same test on the runtime before the bf16 reference: 0.7034832835197449 again, to every
#   digit: the gap is bf16 kernels' rounding between policy and reference, not the change. The bound is now 3%.
eval "$RAY" || exit
timeout 110 python3 -m pytest -q -m gpu tests/jobs/test_gpu.py -k "dpo_full_offloaded or cpu_offload_trains" -p no:cacheprovider
