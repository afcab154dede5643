#!/usr/bin/env bash
# One entry point for a fresh machine:  bash scripts/dev.sh COMMAND [args...]
#   setup        create .venv/ and install the locked environment (CPU torch unless told otherwise)
#   demo         setup, then import the sample server in data/ and run searches offline
#   test         setup, then ruff, mypy and the whole test suite (what CI runs)
#   quick        setup, then the tests not marked slow (no real MiniLM, no large corpora)
#   lock         refresh requirements/py3XX.txt from pyproject.toml's ranges (newest releases)
#   test-latest  the suite in a throw-away environment of the newest releases the ranges allow
#                (run it before `lock`: what it finds is what the refreshed lock would bring)
#   test-oldest  the same with the oldest release of every direct dependency the ranges allow
#
# The lock (requirements/py311.txt, py312.txt: exact versions with hashes, made by uv)
# decides what a new machine installs.  PyPI's torch for Linux is the multi-GB CUDA
# build, and which build a machine wants differs, so torch stays out of the lock (its
# own dependencies are in it) and is installed on its own, after the locked rest:
#   TORCH_SPEC       what to install (default torch==2.13.0)
#   TORCH_INDEX_URL  an extra index for it, e.g. https://download.pytorch.org/whl/cu128
#                    for NVIDIA GPUs or .../whl/cpu for a CPU-only build from PyTorch
set -euo pipefail

cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then  # chosen: it must run (never a silent fall back to another Python)
    "$PYTHON" -c '' >/dev/null 2>&1 || { echo "error: PYTHON=$PYTHON does not run here" >&2; exit 2; }
else
    PYTHON=python3.11
    "$PYTHON" -c '' >/dev/null 2>&1 || PYTHON=python3
fi
VENV=.venv
STAMP=$VENV/.installed
TORCH=${TORCH_SPEC:-torch==2.13.0}
UV_SPEC=uv==0.13.9  # the lock's tool, pinned like the linters

lock_file() {  # the lock for the interpreter $1
    local version
    version=$("$1" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
    if [ ! -f "requirements/py$version.txt" ]; then
        echo "error: no lock for Python ${version:0:1}.${version:1} (requirements/py$version.txt); use Python 3.11 or 3.12 (PYTHON=python3.12)" >&2
        exit 2
    fi
    echo "requirements/py$version.txt"
}

new_venv() {  # new_venv DIR: a virtual environment of $PYTHON with a current pip
    "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11 or newer is required"'
    "$PYTHON" -m venv "$1"
    "$1/bin/python" -m pip install --quiet --upgrade pip
}

install_torch() {  # install_torch PYTHON: $TORCH, saying first if it is not a CPU build
    local py=$1
    if "$py" -c 'import torch' >/dev/null 2>&1; then
        return 0
    fi
    local index=(${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"})
    local plan
    plan=$("$py" -m pip install --quiet --dry-run --ignore-installed --report - "${index[@]}" "$TORCH" \
        | "$py" -c 'import json, sys
items = json.load(sys.stdin)["install"]
print(" ".join(i["metadata"]["name"] + "==" + i["metadata"]["version"] for i in items))')
    case " $plan " in
        *" torch=="*"+cpu "*) echo "installing $TORCH, CPU build (set TORCH_SPEC/TORCH_INDEX_URL to change)" >&2 ;;
        *" nvidia-"*)
            echo "note: no CPU build of $TORCH for this Python is on the configured indexes, so pip" >&2
            echo "      will download the CUDA build and its NVIDIA libraries (several GB):" >&2
            echo "      $plan" >&2
            echo "      For the CPU build instead: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" >&2 ;;
        *) echo "installing $TORCH: $plan" >&2 ;;
    esac
    "$py" -m pip install --quiet "${index[@]}" "$TORCH"
}

setup() {
    local lock
    lock=$(lock_file "$PYTHON") || exit 2
    local want
    want="$(cat pyproject.toml "$lock" | sha256sum | cut -c1-16) $TORCH ${TORCH_INDEX_URL:-}"
    if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
        return 0
    fi
    if [ -f "$STAMP" ]; then
        # pip would leave behind what the old lock had and the new one dropped: start clean
        echo "the lock, pyproject.toml or the torch choice changed: rebuilding $VENV/" >&2
        rm -rf "$VENV"
    fi
    [ -x "$VENV/bin/python" ] || new_venv "$VENV"
    if [ "$(uname -sm)" = "Linux x86_64" ]; then
        # Exactly the locked versions, each checked against its hash; nothing else resolved.
        "$VENV/bin/python" -m pip install --quiet --require-hashes --no-deps -r "$lock"
        install_torch "$VENV/bin/python"
        # The project itself, built with the locked setuptools (no unlocked build download).
        "$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e .
    else
        echo "note: the lock is for Linux x86-64; on $(uname -sm) pip resolves pyproject.toml's ranges" >&2
        install_torch "$VENV/bin/python"
        "$VENV/bin/python" -m pip install --quiet -e ".[test]"
    fi
    "$VENV/bin/python" -m pip check >/dev/null || { "$VENV/bin/python" -m pip check >&2; exit 1; }
    echo "$want" > "$STAMP"
}

uv() {  # uv, installed on first use into .venv-tools/ (never into the project's environment)
    [ -x .venv-tools/bin/uv ] || { new_venv .venv-tools; .venv-tools/bin/python -m pip install --quiet "$UV_SPEC"; }
    .venv-tools/bin/uv "$@"
}

compile() {  # compile PYVERSION OUT [uv args...]: resolve pyproject.toml's ranges for Linux x86-64
    local version=$1 out=$2
    shift 2
    uv pip compile --quiet pyproject.toml --extra test --overrides requirements/overrides.txt \
        --python-version "$version" --python-platform x86_64-manylinux_2_28 --output-file "$out" "$@"
}

lock() {
    compile 3.11 requirements/py311.txt requirements/torch-deps.in --generate-hashes --upgrade
    compile 3.12 requirements/py312.txt requirements/torch-deps.in --generate-hashes --upgrade
    echo "refreshed requirements/py311.txt and py312.txt; run: bash scripts/dev.sh test" >&2
}

throwaway_test() {  # throwaway_test newest|lowest-direct [pytest args...]
    local resolution=$1
    shift
    local dir
    dir=$(mktemp -d "${TMPDIR:-/tmp}/memory-bot-$resolution.XXXXXX")
    trap "rm -rf '$dir'" EXIT  # expanded now: the local is gone when the trap runs
    chmod 755 "$dir"  # mktemp's 700 would hide the venv from tests that run bot.py as another user
    new_venv "$dir/venv"
    local version
    version=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    # torch's own dependencies are left to pip when it installs torch (newest releases)
    compile "$version" "$dir/requirements.txt" --resolution "$resolution" --no-header
    echo "testing against ($resolution):" >&2
    grep -E '^(discord-py|transformers|accelerate|sentence-transformers|numpy|sqlite-vec|httpx|click|tokenizers)==' \
        "$dir/requirements.txt" | sed 's/^/  /' >&2
    "$dir/venv/bin/python" -m pip install --quiet --no-deps -r "$dir/requirements.txt"
    install_torch "$dir/venv/bin/python"
    "$dir/venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e .
    "$dir/venv/bin/python" -m pip check
    "$dir/venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
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
    lock) lock ;;
    test-latest) throwaway_test highest "$@" ;;
    test-oldest) throwaway_test lowest-direct "$@" ;;
    *) echo "usage: bash scripts/dev.sh setup|demo|test|quick|lock|test-latest|test-oldest [args...]" >&2; exit 2 ;;
esac
