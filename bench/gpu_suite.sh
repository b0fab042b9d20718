#!/usr/bin/env bash
# The GPU suite in one command, from a bare GPU machine holding this working tree:
#
#   bench/gpu_suite.sh OUT [--dry-run | --reduced] [--parts ...] [--limit PART=SECONDS]
#
# What the machine lacks travels in .gpu-wheels/ (bench/gpu_wheels.sh): wheels, installed
# here with pip --no-index --target into a folder put first on PYTHONPATH, and the default
# model in parts, joined and checked here. jaxserve runs from the tree (PYTHONPATH=.).
# $PYTHON picks the interpreter (default python3). See bench/gpu_suite.py for the parts.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/gpu_suite.sh OUT [--dry-run | --reduced] [--parts ...]}
shift
mkdir -p "$out"
py=${PYTHON:-python3}
wheels=.gpu-wheels
work=${TMPDIR:-/tmp}/jaxserve-gpu-suite
mkdir -p "$work"

# the wheels, only where the interpreter lacks what they carry
if ! "$py" -c "import msgspec, gguf" 2>/dev/null; then
    if ! ls $wheels/wheels/*.whl >/dev/null 2>&1; then
        echo "msgspec or gguf missing and no $wheels/wheels: run bench/gpu_wheels.sh" >&2
        exit 2
    fi
    "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade \
        --target "$work/site" $wheels/wheels/*.whl || exit 2
    export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
fi

# the default model, from its parts, where checkpoints/ lacks it
model=SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "${JAXSERVE_CHECKPOINTS:-checkpoints}/$model" ] \
        && ls $wheels/checkpoints/$model.part-* >/dev/null 2>&1; then
    mkdir -p "$work/checkpoints"
    cat $wheels/checkpoints/$model.part-* > "$work/checkpoints/$model"
    if (cd "$work/checkpoints" && sha256sum --quiet -c "$OLDPWD/$wheels/checkpoints/SHA256SUMS"); then
        export JAXSERVE_CHECKPOINTS="$work/checkpoints"
    else
        echo "the model's parts do not match $wheels/checkpoints/SHA256SUMS" \
             "(a part missing?): the serving part will fail" >&2
        rm -f "$work/checkpoints/$model"
    fi
fi

export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the engine part holds a Llama-3-8B's weights and a 69 GB KV pool
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
exec "$py" bench/gpu_suite.py "$out" "$@"
