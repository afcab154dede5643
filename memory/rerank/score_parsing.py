"""What scoring servers answer, read as relevance scores: pure functions, no HTTP.

Shared by every backend that scores over HTTP.  llama-server's three endpoints
answer differently (:mod:`memory.rerank.llama_server`): ``/completion`` and
``/v1/chat/completions`` report the top log-probabilities of the one generated
token, of which P(yes) over {yes, no} is the score (:func:`yes_probability`,
exactly what the in-process backend computes from the two logits); ``/v1/rerank``
returns P(yes) per document already.  The rest is for any server:
:func:`typed_field` checks a JSON field (:mod:`memory.rerank.llama_http`),
and :func:`sigmoid` turns a logit into a probability (:mod:`memory.rerank.rerank_api`);
text goes out through :func:`memory.text.valid_unicode`, safe to send as JSON.
Every malformed answer is a :class:`ValueError` naming what is missing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

# A token missing from the top list is placed this many nats below the lowest listed one.
MISSING_TOKEN_MARGIN = 1.0
# Smallest leftover probability considered, so log(leftover) stays finite (about -30).
MIN_LEFTOVER = 1e-13
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)


# --------------------------------------------------------------------------- math


def logsumexp(values: Sequence[float]) -> float:
    """Return ``log(sum(exp(v)))`` computed without overflow or underflow.

    Raises:
        ValueError: ``values`` is empty.
    """
    top = max(values)
    if math.isinf(top):
        return top
    return top + math.log(sum(math.exp(v - top) for v in values))


def sigmoid(x: float) -> float:
    """Return ``1 / (1 + exp(-x))``, stable for large ``|x|``."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def _missing_logprob(listed: Sequence[float]) -> float:
    """Estimate the logprob of an answer token absent from the top list.

    An absent token is less likely than every listed one and than the probability mass
    the list leaves over; take the smaller of (lowest listed - margin) and
    log(leftover), which is at least about -30.
    """
    leftover = 1.0 - sum(math.exp(lp) for lp in listed)
    return min(min(listed) - MISSING_TOKEN_MARGIN, math.log(max(leftover, MIN_LEFTOVER)))


def yes_probability(top_logprobs: Sequence[Any]) -> float:
    """Return P(yes) over {yes, no} from llama-server's ``top_logprobs`` list.

    Token strings are normalised with ``strip().lower()`` (" Yes", "YES" and "yes" are
    the same answer) and duplicates are combined by log-sum-exp.  The score is the
    softmax over the two, ``sigmoid(lp_yes - lp_no)``, which is exactly what the
    in-process backend computes from the two logits.  A token missing from the list
    gets a floor logprob (see :func:`_missing_logprob`).

    Args:
        top_logprobs: ``[{"token": str, "logprob": float}, ...]``.

    Returns:
        The relevance score in [0, 1].

    Raises:
        ValueError: An entry is malformed, or neither "yes" nor "no" is listed.
    """
    answers: dict[str, list[float]] = {"yes": [], "no": []}
    listed: list[float] = []
    for entry in top_logprobs:
        token = typed_field(entry, "token", str).strip().lower()
        logprob = _number(entry, "logprob")
        listed.append(logprob)
        if token in answers:
            answers[token].append(logprob)
    if not answers["yes"] and not answers["no"]:
        raise ValueError(f"neither 'yes' nor 'no' among the {len(listed)} top tokens")
    floor = _missing_logprob(listed)
    lp_yes = logsumexp(answers["yes"]) if answers["yes"] else floor
    lp_no = logsumexp(answers["no"]) if answers["no"] else floor
    return sigmoid(lp_yes - lp_no)


def answer_from_text(text: str) -> float:
    """Return 1.0 for a generated "yes", 0.0 for "no" (last resort without logprobs).

    Any ``<think>...</think>`` block the server echoes is dropped first, so
    ``"<think>\\n\\n</think>\\n\\nno"`` reads as "no".

    Raises:
        ValueError: What is left is neither yes nor no.
    """
    answer = _THINK_BLOCK.sub("", text).strip().lower()
    if answer in ("yes", "no"):
        return 1.0 if answer == "yes" else 0.0
    raise ValueError(f"no logprobs, and the generated text {text!r} is neither yes nor no")


# ------------------------------------------------------------------------ parsing


def typed_field(obj: Any, key: str | int, kind: type) -> Any:
    """Return ``obj[key]`` if it exists and is a ``kind``; else raise ValueError."""
    try:
        value = obj[key]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"missing {key!r}") from None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{key!r} is {type(value).__name__}, expected {kind.__name__}")
    return value


def _number(obj: Any, key: str) -> float:
    """Return ``obj[key]`` as a float, rejecting booleans, null and NaN."""
    value = typed_field(obj, key, object)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise ValueError(f"{key!r} is not a number: {value!r}")
    return float(value)


def _first_top(entries: Any) -> list[Any]:
    """Return ``entries[0].top_logprobs`` when it is a non-empty list, else []."""
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        return []
    top = entries[0].get("top_logprobs")
    return top if isinstance(top, list) else []


def parse_completion_score(body: Any) -> float:
    """Return the relevance score from one ``/completion`` response.

    The score comes from ``completion_probabilities[0].top_logprobs`` (see
    :func:`yes_probability`); without it (llama-server leaves it out when the sampled
    token is an incomplete UTF-8 piece) the generated ``content`` decides
    (:func:`answer_from_text`).

    Raises:
        ValueError: The response lacks the fields needed, or the answer is unusable.
    """
    if not isinstance(body, dict):
        raise ValueError(f"expected an object, got {type(body).__name__}")
    top = _first_top(body.get("completion_probabilities"))
    if top:
        return yes_probability(top)
    return answer_from_text(typed_field(body, "content", str))


def parse_chat_score(body: Any) -> float:
    """Return the relevance score from one ``/v1/chat/completions`` response.

    The score comes from ``choices[0].logprobs.content[0].top_logprobs`` (see
    :func:`yes_probability`); without top logprobs the generated
    ``choices[0].message.content`` decides (:func:`answer_from_text`).

    Raises:
        ValueError: The response lacks the fields needed, or the answer is unusable.
    """
    choice = typed_field(typed_field(body, "choices", list), 0, dict)
    logprobs = choice.get("logprobs")
    top = _first_top(logprobs.get("content") if isinstance(logprobs, dict) else None)
    if top:
        return yes_probability(top)
    return answer_from_text(typed_field(typed_field(choice, "message", dict), "content", str))


def parse_rerank_scores(body: Any, count: int) -> list[float]:
    """Return one score per document, in input order, from a ``/v1/rerank`` response.

    Results may come in any order (llama-server sorts them by score), so they are
    mapped back by ``index``.  For a Qwen3-Reranker rank GGUF ``relevance_score`` is
    already P(yes) (llama.cpp takes the softmax over the yes/no rows), so it is used
    as is; a score outside [0, 1] means the GGUF is some other kind of reranker.

    Args:
        body: The decoded JSON response.
        count: How many documents were sent.

    Raises:
        ValueError: A field is missing, an index is out of range, a score is not a
            probability, or a document has no result.
    """
    scores: dict[int, float] = {}
    for item in typed_field(body, "results", list):
        index = typed_field(item, "index", int)
        if not 0 <= index < count:
            raise ValueError(f"result index {index} is out of range for {count} documents")
        score = _number(item, "relevance_score")
        if not 0.0 <= score <= 1.0:
            raise ValueError(
                f"relevance_score {score:g} is not a probability: serve a Qwen3-Reranker "
                "GGUF converted with rank pooling"
            )
        scores[index] = score
    missing = [i for i in range(count) if i not in scores]
    if missing:
        raise ValueError(f"no result for document index(es) {missing[:10]}")
    return [scores[i] for i in range(count)]
