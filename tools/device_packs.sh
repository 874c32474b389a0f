#!/usr/bin/env bash
# What the GPU machine's checks need beside the workplace's Ray and Unsloth packs, added to them in place.
#
# Run from the project's root after the Ray pack has written .whl-ray/ and the Unsloth pack .whl-unsloth/:
# - .whl-ray/ gains bitsandbytes slimmed to CUDA 13 (the Unsloth pack's bnb-slim.tar.xz, as
#   bitsandbytes-slim.tar.xz): QLoRA's checks and GPU tests load 4-bit bases through it;
# - .whl-unsloth/ gains the Ray pack's wheels but Ray (pydantic and its kin: vs_hf.py runs tunewright beside
#   Unsloth, without Ray, and tunewright_core needs them) and liger-kernel (HF + Liger, not in the GPU image).
# The two cannot travel in one call (64 MiB a call): each check's device call says which it carries.
#
#   bash tools/device_packs.sh
set -euo pipefail
ray=.whl-ray
unsloth=.whl-unsloth
limit=$((64 * 1024 * 1024))
for pack in "$ray" "$unsloth"; do
  [ -d "$pack" ] || { echo "$pack/ is missing: run the workplace's pack script for it first" >&2; exit 2; }
done
[ -f "$unsloth/bnb-slim.tar.xz" ] || { echo "$unsloth/bnb-slim.tar.xz is missing: run the Unsloth pack again" >&2; exit 2; }
cp "$unsloth/bnb-slim.tar.xz" "$ray/bitsandbytes-slim.tar.xz"
cp "$ray"/*.whl "$unsloth/"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  -d "$unsloth" liger-kernel==0.8.5
for pack in "$ray" "$unsloth"; do
  size=$(du -sb "$pack" | cut -f1)
  echo "$pack: $((size / 1024 / 1024)) MiB"
  [ "$size" -lt "$limit" ] || { echo "$pack is over the 64 MiB a device call carries" >&2; exit 1; }
done
