"""One bot process of a sharded bot, for the multi-process tests.

``python -m tests.support.shard_bot --db URL --api BASE --shard-count N --shards a,b
--embeds FILE`` runs what ``bot.py run --shard-count N --shards a,b`` runs
(:func:`cli.run.run_bot`: the engine, the sharded bot, retries, SIGTERM's clean
shutdown) against the stand-ins of :mod:`tests.support.gateway_standin`, with two
differences a test needs: discord.py's REST base URL and gateway URL point at the
stand-in (as the in-process tests set them), and the embedder is the deterministic
:class:`~tests.support.builders.HashEmbedder`, which also appends every text it
embeds to ``--embeds`` (one JSON string a line), so the test can count how often
each message was embedded across all processes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import discord
import numpy as np
import yarl

from cli.run import run_bot
from cogs.memory.shards import Shards
from memory.config import Profile, ReconcileConfig, RerankerConfig
from memory.engine import MemoryEngine
from tests.support.builders import HashEmbedder

TOKEN = "good-token"
PROFILE = Profile(name="test", reranker=RerankerConfig(backend="none"),
                  reconcile=ReconcileConfig(pause_s=0))


class RecordingEmbedder(HashEmbedder):
    """A :class:`HashEmbedder` that appends each text it embeds to a file."""

    def __init__(self, log: Path) -> None:
        super().__init__()
        self.log = log

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts`` and write them down, one JSON string a line."""
        vectors = super().embed(texts)
        with self.log.open("a", encoding="utf-8") as out:
            out.writelines(json.dumps(text) + "\n" for text in texts)
        return vectors


def main(argv: Sequence[str] | None = None) -> int:
    """Run one process of the sharded bot until SIGTERM; return its exit code."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--db", required=True)
    parser.add_argument("--api", required=True, help="the stand-in's REST base URL")
    parser.add_argument("--shard-count", type=int, required=True)
    parser.add_argument("--shards", required=True, help="comma-separated shard ids")
    parser.add_argument("--owner", type=int, required=True)
    parser.add_argument("--embeds", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    discord.http.Route.BASE = args.api
    port = yarl.URL(args.api).port
    discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(f"ws://127.0.0.1:{port}/ws")
    shards = Shards(args.shard_count, tuple(int(i) for i in args.shards.split(",")))
    engine = MemoryEngine(args.db, PROFILE, RecordingEmbedder(args.embeds), load_reranker=False)
    return run_bot(engine, TOKEN, shards=shards, owner_ids={args.owner}, retry_delays=(0.5,))


if __name__ == "__main__":
    sys.exit(main())
