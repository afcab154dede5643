"""A tiny, locally built Qwen3 causal LM and tokenizer for reranker tests.

The model has the real Qwen3 architecture (``transformers.Qwen3ForCausalLM``) at toy
size, and the tokenizer is a byte-level BPE trained here, at fixture time, on a small
built-in corpus.  It pre-tokenizes with Qwen's own split pattern and NFC
normalisation, knows the Qwen chat special tokens, and has ``yes`` and ``no`` as
single tokens, so the official reranker prompt tokenizes the way it does for the
real model: in particular, the head/document split used by the shared-prefix cache
is exact.  Byte-level means any unicode input (emoji, NUL, zero-width characters)
encodes without unknown tokens.

Everything is seeded, so a saved folder always yields the same scores.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from benchmarks.qwen_models import TINY_QWEN3, qwen3_config, qwen_fast_tokenizer
from memory.config import QwenConfig
from memory.rerank.prompt import (
    DEFAULT_INSTRUCTION,
    PREFIX,
    QWEN_SPLIT_PATTERN,
    SUFFIX,
    SYSTEM_PROMPT,
)
from memory.rerank.qwen import QwenReranker

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added but not "special" in Qwen3's tokenizer: they still encode as one token.
THINK_TOKENS = ("<think>", "</think>")

_CHAT_LINES = (
    "does anyone know when the raid starts on saturday",
    "yes it starts at 9pm server time, check the pinned message",
    "no idea, ask the officers in the other channel",
    "the deploy broke again because the migration was not applied",
    "can someone review my pull request before friday please",
    "i think the bot is down, it is not answering commands",
    "lol same, my build keeps failing on the windows runner",
    "remember to bring snacks to the meetup next week",
    "what was the name of that recipe with lentils and lemon",
    "the password for the wifi is on the fridge, not in the chat",
)


def training_corpus() -> list[str]:
    """Return the text the tiny tokenizer learns its merges from."""
    prompt = PREFIX + f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: q\n<Document>: d" + SUFFIX
    answers = ["yes", "no", "\nyes\n", "\nno\n", "yes no yes no"]
    return [SYSTEM_PROMPT, prompt, *_CHAT_LINES] * 20 + answers * 50


def build_tokenizer(vocab_size: int = 1000) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with the Qwen chat special tokens.

    Args:
        vocab_size: Target size including the 256 byte tokens and the special
            tokens.  A size that leaves no room for merges gives a byte-only
            tokenizer, in which "yes" and "no" are not single tokens.

    Returns:
        A fast tokenizer that can be saved with ``save_pretrained``.
    """
    specials = [*SPECIAL_TOKENS, *THINK_TOKENS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    assert all(tok.token_to_id(t) is not None for t in specials)
    return qwen_fast_tokenizer(tok)


def build_model(vocab_size: int, seed: int = 0, init_std: float = 0.2) -> Qwen3ForCausalLM:
    """Build a seeded two-layer Qwen3 causal LM in float32.

    Args:
        vocab_size: Rows of the (tied, as in Qwen3-Reranker-0.6B) embedding and lm_head.
        seed: Torch seed for the random weights.
        init_std: Weight init std.  Ten times the usual 0.02, so the last hidden
            state depends on the document and yes/no scores spread over (0, 1)
            instead of all sitting near 0.5.

    Returns:
        The model in eval mode.
    """
    torch.manual_seed(seed)
    config = qwen3_config(TINY_QWEN3, vocab_size=vocab_size, initializer_range=init_std)
    return Qwen3ForCausalLM(config).eval()


def save_tiny_reranker(folder: str | Path, seed: int = 0, with_answers: bool = True) -> Path:
    """Build the tiny model and tokenizer and ``save_pretrained`` both to ``folder``.

    Args:
        folder: Where to write ``config.json``, the weights and the tokenizer files.
        seed: Torch seed for the weights.
        with_answers: When false, the tokenizer is byte-only, so "yes" and "no"
            are not single tokens (for the missing-token error path).

    Returns:
        The folder, loadable with ``AutoModelForCausalLM`` / ``AutoTokenizer``.
    """
    folder = Path(folder)
    tokenizer = build_tokenizer(1000 if with_answers else 0)
    model = build_model(len(tokenizer), seed=seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def wrap(parts: tuple, config: QwenConfig, **overrides: object) -> QwenReranker:
    """A :class:`QwenReranker` over an already loaded ``(model, tokenizer)``, with
    ``config``'s fields changed by ``overrides``."""
    model, tokenizer = parts
    return QwenReranker.from_model(model, tokenizer, dataclasses.replace(config, **overrides))
