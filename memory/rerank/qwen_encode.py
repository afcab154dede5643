"""Token ids of one search's prompts, the documents' possibly still being tokenized.

A reranker prompt is a head (system message, instruction, query) and one tail per
candidate (the document, then the suffix).  The static path runs the head first, as
a step of its own, and needs the tails only after it: so when that path serves,
:class:`PromptEncoder` tokenizes the head at once and the documents on a thread of
its own, and the head step runs on the GPU meanwhile (issue 33: on an H200 a
30-candidate search took 9.7 ms, of which its steps 8.2 ms; tokenizing came first).
The fast tokenizer's Rust code releases the GIL, and a :class:`TokenizerProcess` is
waited on through a pipe, so the two really overlap.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from memory.rerank.prompt import document_text, head_text

log = logging.getLogger(__name__)

Documents = tuple[list[list[int]], int]  # the tails, and how many texts lost tokens


@dataclass(frozen=True)
class EncodedQuery:
    """Token ids of one query's prompts, split for the shared-prefix cache.

    Attributes:
        head: Ids of :func:`prompt.head_text` (system, instruction, query).
        documents: The tails and the truncation count, or a future of them while the
            documents are tokenized in the background (:meth:`PromptEncoder.encode`).
    """

    head: list[int]
    documents: Documents | Future[Documents]

    @property
    def tails(self) -> list[list[int]]:
        """Per text, in input order: the (possibly truncated) document ids followed by
        the suffix ids; ``head + tails[i]`` is the whole prompt.  Waits for a
        background tokenization and raises what it raised."""
        return self.tokenized()[0]

    @property
    def truncated(self) -> int:
        """How many texts lost tokens to ``max_length``."""
        return self.tokenized()[1]

    @property
    def tokens(self) -> int:
        """Prompt tokens over all texts, counting the head once per text."""
        return sum(len(self.head) + len(t) for t in self.tails)

    def tokenized(self) -> Documents:
        """The tails and the truncation count, once tokenized."""
        documents = self.documents
        return documents.result() if isinstance(documents, Future) else documents


class PromptEncoder:
    """Tokenizes prompts with one tokenizer, one call at a time.

    A Rust tokenizer is not to be called from two threads at once, so every call
    holds one lock; the background tokenizing runs on one thread, started on first
    use and stopped by :meth:`close`.

    Args:
        instruction: The profile's reranker instruction.
        max_length: The profile's ``max_length``: only documents are truncated to fit.
    """

    def __init__(self, instruction: str, max_length: int) -> None:
        self.instruction = instruction
        self.max_length = max_length
        self._lock = threading.Lock()  # the tokenizer
        self._thread: ThreadPoolExecutor | None = None
        self._thread_lock = threading.Lock()

    def encode(
        self, tokenizer: Any, suffix: list[int], query: str, texts: Sequence[str],
        background: bool = False,
    ) -> EncodedQuery:
        """Tokenize the head now and the documents now or, with ``background``, on this
        encoder's thread (:attr:`EncodedQuery.documents` is then a future).

        Each document keeps at most ``max_length - len(head) - len(suffix)`` tokens (at
        least one), so query and template stay intact.
        """
        with self._lock:
            head = list(tokenizer(head_text(self.instruction, query),
                                  add_special_tokens=False)["input_ids"])
        if len(head) + len(suffix) >= self.max_length:
            log.warning(
                "reranker prompt head is %d tokens, over max_length %d: raise "
                "reranker.max_length or shorten the query", len(head), self.max_length,
            )
        budget = max(1, self.max_length - len(head) - len(suffix))
        texts = list(texts)  # the caller's list may change while the thread reads it
        if background:
            with self._thread_lock:  # not onto an executor close() is shutting down
                if self._thread is None:
                    self._thread = ThreadPoolExecutor(1, thread_name_prefix="reranker-tokenize")
                pending = self._thread.submit(self._documents, tokenizer, suffix, texts, budget)
            return EncodedQuery(head, pending)
        return EncodedQuery(head, self._documents(tokenizer, suffix, texts, budget))

    def close(self) -> None:
        """Stop the background thread once its queued work is done (a later
        :meth:`encode` starts another)."""
        with self._thread_lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=False)

    def _documents(
        self, tokenizer: Any, suffix: list[int], texts: list[str], budget: int
    ) -> Documents:
        with self._lock:
            docs = tokenizer([document_text(t) for t in texts],
                             add_special_tokens=False)["input_ids"]
        truncated = sum(len(d) > budget for d in docs)
        return [list(d[:budget]) + suffix for d in docs], truncated
