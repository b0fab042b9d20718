#!/usr/bin/env bash
# Build .gpu-wheels/: what the GPU machine (Python 3.12, jax 0.11.2 and the CUDA 13 plugin,
# no network) lacks to run bench/gpu_suite.sh, downloaded here.
#
#   bench/gpu_wheels.sh            # needs pip and a package registry; PYTHON picks pip's python
#
# - wheels/: msgspec and gguf (missing there), and flax at the version this tree is tested
#   with on jax 0.11.2 (the machine's own may differ); Python 3.12, manylinux x86-64.
# - checkpoints/: the default model's GGUF in two parts with their SHA256SUMS. A device
#   call carries at most 64 MiB, less than the 98 MB file: carry one part with each of two
#   calls to a warm machine (the README's GPU section says how).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
dest=.gpu-wheels
model=SmolLM2-135M-Instruct.Q4_1.gguf
rm -rf "$dest"
mkdir -p "$dest/wheels" "$dest/checkpoints"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest/wheels" \
    msgspec==0.23.0 gguf==0.19.0 flax==0.12.12
[ -f "checkpoints/$model" ] || "$py" jaxserve/checkpoint/default_model.py
split -n 2 -d "checkpoints/$model" "$dest/checkpoints/$model.part-"
(cd checkpoints && sha256sum "$model") > "$dest/checkpoints/SHA256SUMS"
du -sh "$dest" "$dest"/* "$dest"/checkpoints/*
