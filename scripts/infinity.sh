#!/usr/bin/env bash
# Install the Infinity rerank/embedding server (PyPI's infinity-emb) in a virtual
# environment of its own, in a cache folder outside the repository, as a server owner
# would run it next to the bot.
#
#   bash scripts/infinity.sh          # install if missing, print the infinity_emb path
#   bash scripts/infinity.sh --path   # print the path if installed, exit 1 if not
#   bash scripts/infinity.sh serve MODEL [infinity_emb v2 options...]
#                                     # install if missing, then serve MODEL (a hub id or
#                                     # a local folder) on port 7997, or --port
#
# Infinity keeps a cache folder, .infinity_cache, in $INFINITY_HOME or else in the folder
# it starts in; `serve` sets INFINITY_HOME to the install folder (unless already set) so
# that it never lands in the repository or wherever you happen to be, and turns off
# Infinity's anonymous usage statistics.
#
# infinity-emb pins sentence-transformers<4 and numpy<2, which the bot's own
# environment cannot hold, hence the separate venv.  CPU torch goes in first (as
# scripts/dev.sh does) so pip does not pull the multi-GB CUDA build.  A few minutes.
# The tests of the rerank-api backend's Infinity dialect find the server here (or at
# $INFINITY_EMB) and skip with a reason when it is absent.
#
#   INFINITY_VERSION  infinity-emb release (default 0.0.78)
#   INFINITY_CACHE    where to install (default ${XDG_CACHE_HOME:-~/.cache}/discord-memory-bot/infinity)
#   TORCH_SPEC, TORCH_INDEX_URL  as for scripts/dev.sh
set -euo pipefail

VERSION=${INFINITY_VERSION:-0.0.78}
CACHE=${INFINITY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/discord-memory-bot/infinity}
ROOT="$CACHE/$VERSION"
BIN="$ROOT/venv/bin/infinity_emb"
DONE="$ROOT/.installed"  # written last: a half-finished install is redone
TORCH=${TORCH_SPEC:-torch==2.13.0}
PYTHON=${PYTHON:-python3.11}
"$PYTHON" -c '' >/dev/null 2>&1 || PYTHON=python3

install() {  # install infinity-emb into $ROOT/venv unless it is there already
    if [ -f "$DONE" ] && [ -x "$BIN" ]; then
        return 0
    fi
    mkdir -p "$ROOT"
    rm -rf "$ROOT/venv"
    "$PYTHON" -m venv "$ROOT/venv"
    local pip=("$ROOT/venv/bin/python" -m pip install --quiet)
    local index=(${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"})
    "${pip[@]}" "${index[@]}" "$TORCH" >&2
    "${pip[@]}" "infinity-emb[server,torch]==$VERSION" >&2
    "$ROOT/venv/bin/infinity_emb" --help >/dev/null
    echo "infinity-emb $VERSION" > "$DONE"
}

case "${1:-}" in
    --path)
        [ -f "$DONE" ] && [ -x "$BIN" ] && { echo "$BIN"; exit 0; }
        exit 1 ;;
    serve)
        [ -n "${2:-}" ] || { echo "usage: bash scripts/infinity.sh serve MODEL [infinity_emb v2 options...]" >&2; exit 2; }
        model=$2
        shift 2
        install
        export INFINITY_HOME=${INFINITY_HOME:-$ROOT}
        export INFINITY_ANONYMOUS_USAGE_STATS=0 DO_NOT_TRACK=1
        exec "$BIN" v2 --model-id "$model" "$@" ;;
    "")
        install
        echo "$BIN" ;;
    *)
        echo "usage: bash scripts/infinity.sh [--path | serve MODEL [infinity_emb v2 options...]]" >&2
        exit 2 ;;
esac
