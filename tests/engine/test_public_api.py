"""memory/__init__.py declares the engine's public API, and loads it only when used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import memory
from memory import engine, errors, records
from memory.rerank import service
from memory.search import request

ROOT = Path(__file__).resolve().parents[2]


def test_every_public_name_is_the_class_of_its_home_module() -> None:
    homes = {"MemoryEngine": engine, "SearchRequest": request, "SearchResult": records,
             "Hit": records, "Trace": records, "RerankerStatus": service}
    for name in memory.__all__:
        assert getattr(memory, name) is getattr(homes.get(name, errors), name)
    assert set(memory.__all__) >= set(homes) | {"MemoryBotError", "SearchInputError"}
    assert issubclass(memory.RerankerUnavailable, memory.MemoryBotError)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Searcher'"):
        memory.Searcher  # noqa: B018 - the access is the test


def test_importing_a_light_module_does_not_load_the_engine() -> None:
    script = "import sys, memory.text; print('memory.engine' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_close_closes_the_database_even_when_unloading_is_interrupted(engine, monkeypatch):
    # Ctrl-C while the reranker waits for its background compile (issue 33): the
    # database is closed all the same, so nothing stored is left in an open handle
    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.rerankers, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.close()
    with pytest.raises(Exception, match="closed"):
        engine.storage.stats()
