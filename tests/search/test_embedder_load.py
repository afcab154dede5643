"""Loading the bundled MiniLM changes nothing for the rest of the process.

It once set ``HF_HUB_OFFLINE=1`` when it loaded from its folder: on a machine with
network, a reranker loaded after it (the default profile's Qwen3 from the hub) could
then not download, and said it was "not on this machine".
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memory.config import ConfigError, EmbedderConfig, parse_profile
from memory.embedder import SentenceTransformerEmbedder

ROOT = Path(__file__).resolve().parents[2]

LOAD = """
import os
from memory.config import EmbedderConfig
from memory.embedder import SentenceTransformerEmbedder
embedder = SentenceTransformerEmbedder(EmbedderConfig())
print(embedder.dimension, os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
"""


def test_the_bundled_embedder_loads_without_the_hub_and_leaves_it_reachable() -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # nothing answers there: a hub request would fail (and retry) instead of loading
    env |= {"PYTHONPATH": str(ROOT), "HF_ENDPOINT": "http://127.0.0.1:9", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["384", "None", "None"]


@pytest.mark.parametrize("folder", ["empty", "foreign", "broken-json"])
def test_a_folder_that_is_no_model_is_a_config_error(tmp_path: Path, folder: str) -> None:
    """An empty folder, a folder of something else, or a damaged modules.json raised
    ValueError or JSONDecodeError, a traceback for `import` and `reembed`."""
    model = tmp_path / folder
    model.mkdir()
    if folder == "foreign":
        (model / "notes.txt").write_text("not a model", encoding="utf-8")
    if folder == "broken-json":
        (model / "modules.json").write_text("[1", encoding="utf-8")
    embedder = SentenceTransformerEmbedder(EmbedderConfig(model=str(model), device="cpu"))
    with pytest.raises(ConfigError, match="could not be loaded"):
        embedder.embed(["hello"])


def test_a_blank_embedder_model_is_refused_by_the_profile() -> None:
    with pytest.raises(ConfigError, match="embedder.model"):
        parse_profile("blank", {"embedder": {"model": "  "}}, "blank.toml")
