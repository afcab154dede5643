"""Switching away from a loaded reranker unloads it off the event loop, with no full collection.

Issue 30, item 5: the Qwen reranker's unload ran ``gc.collect()``, a walk over every
object in the process that holds the GIL, so the bot's event loop stalled 0.46-1.7 s on
each switch away from a loaded 0.6B model although the unload ran on another thread.
Reference counting frees the weights by itself; these tests watch the collector and the
weights rather than the clock.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest

from memory.config import Profile, QwenConfig, RerankerConfig
from memory.engine import MemoryEngine
from tests.support.builders import HashEmbedder


@contextmanager
def full_collections() -> Iterator[list[str]]:
    """The threads on which a full (generation 2) collection started meanwhile."""
    seen: list[str] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            seen.append(threading.current_thread().name)

    gc.callbacks.append(watch)
    try:
        yield seen
    finally:
        gc.callbacks.remove(watch)


async def wait_for(done: Callable[[], bool], polls: int = 1000) -> bool:
    for _ in range(polls):  # the old service unloads just after the switch resolves
        if done():
            return True
        await asyncio.sleep(0.01)
    return False


def unloads(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().endswith("unloaded")]


@pytest.mark.parametrize("to", ["no reranker", "another transformers model"])
async def test_switching_away_unloads_off_the_loop_without_a_full_collection(
        tiny_dir, tmp_path, caplog, to):
    engine = MemoryEngine(tmp_path / "bot.sqlite3", Profile(name="test"), HashEmbedder(),
                          load_reranker=False)
    qwen = RerankerConfig(backend="transformers",
                          qwen=QwenConfig(model=str(tiny_dir), device="cpu", dtype="float32"))
    loaded = replace(engine.profile, name="loaded", reranker=qwen)
    target = (Profile(name="plain") if to == "no reranker"
              else replace(loaded, name="other", reranker=qwen.with_keys(batch_size=4)))
    try:
        assert await asyncio.wrap_future(engine.switch_profile(loaded)) == "loaded"
        service = engine.rerankers.current()
        assert service is not None and service.status().loaded
        weights = weakref.ref(next(service.backend._model.parameters()))
        del service
        caplog.set_level(logging.INFO, logger="memory.rerank.qwen")
        with full_collections() as collections:
            assert await asyncio.wrap_future(engine.switch_profile(target)) == target.name
            assert await wait_for(lambda: bool(unloads(caplog))), "the old model was unloaded"
        assert weights() is None, "its weights were returned, by reference counting alone"
        assert collections == [], f"full collections ran on {collections}"
        assert [r.threadName for r in unloads(caplog)] == ["reranker-switch"], \
            "the unload ran on the switch's thread, not the event loop's"
    finally:
        engine.close()


async def test_the_bot_freezes_its_start_up_heap_while_it_runs(tmp_path):
    """A full collection then walks only what was made since: one falling on a reranker's
    loading thread no longer holds the GIL for the whole heap (0.6-1 s in bench stalls)."""
    from tests.support.discord_harness import READ, Harness, channel, guild, role

    engine = MemoryEngine(tmp_path / "bot.sqlite3", Profile(name="test"), HashEmbedder(),
                          load_reranker=False)
    h = Harness(engine, [guild(1, "g", owner=2, roles=[role(1, "@everyone", READ, position=0)],
                               members=[], channels=[channel(3, 1, "general")])])
    gc.unfreeze()
    await h.start()
    try:
        assert gc.get_freeze_count() > 0, "what the bot started with is frozen"
    finally:
        await h.bot.close()
    assert gc.get_freeze_count() == 0, "and released when it stops"
