"""Stored messages become vectors: the backlog as it grows, and every message again.

:class:`MessageEmbedder` claims the messages that have no vector yet from the
storage's backlog, embeds them in chunks (each chunk its own transaction, so an
interrupted run keeps what it finished), and sets aside a message the embedder
fails on rather than letting it block the rest.  :meth:`MessageEmbedder.reembed`
fills a new vector table beside the live one and swaps it in.  The engine
(:class:`memory.engine.MemoryEngine`) holds one and hands its calls to it.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from memory.config import EmbedderConfig
from memory.embedder import Embedder
from memory.ingest import Progress
from memory.records import PendingMessage
from memory.storage import Storage, claims
from memory.text import embedding_text, needs_antecedent

log = logging.getLogger(__name__)

EMBED_CHUNK = 256  # messages fetched, encoded and written per step of the backlog


class MessageEmbedder:
    """Embeds stored messages with one model and writes their vectors.

    Args:
        storage: The database: its backlog, vector rebuild and meta.
        embedder: The model.
        config: The profile's ``[embedder]`` section (what of a reply's antecedent
            is embedded with it).
    """

    def __init__(self, storage: Storage, embedder: Embedder, config: EmbedderConfig) -> None:
        self.storage = storage
        self.embedder = embedder
        self.config = config

    def embed_pending(
        self, *, progress: Progress | None = None, stop: threading.Event | None = None,
        chunk: int = 0,
    ) -> int:
        """Embed every stored message that has no vector yet, in chunks.

        Each chunk is written in its own transaction, so an interrupted run keeps
        what it finished and the next run continues with the rest.

        Args:
            progress: Called with the size of each chunk written.
            stop: Once set, the run ends after the chunk it is on (a shutdown waits
                for one chunk, not the whole backlog); the rest stays pending.
            chunk: Messages per step; 0 is :data:`EMBED_CHUNK`.  A caller that may
                have to stop soon (the bot) takes smaller steps.

        Returns:
            How many messages were embedded (a message the embedder failed on is set
            aside instead: :meth:`_embed_batch`).
        """
        backlog = self.storage.backlog
        backlog.retry_set_aside(keep_model=self.embedder.model_id)  # another model failed
        if backlog.pending_count() == 0:
            return 0
        self.storage.meta.bind_model(self.embedder.model_id, self.embedder.dimension)
        owner = claims.process_owner()  # concurrent embedders stay off each other's batches
        done = 0
        try:
            while not (stop is not None and stop.is_set()) and (
                batch := backlog.claim(chunk or EMBED_CHUNK, owner=owner)
            ):
                embedded, vectors = self._embed_batch(batch)
                backlog.write_vectors(embedded, vectors, owner=owner)
                done += len(embedded)  # not those set aside
                if progress:
                    progress(len(batch))
        finally:
            backlog.release(owner)
        log.info("embedded %d messages", done)
        return done

    def _embed_batch(
        self, batch: list[PendingMessage]
    ) -> tuple[list[PendingMessage], np.ndarray]:
        """Embed a claimed batch; the messages the embedder fails on are set aside.

        When the batch fails, each message is tried alone, so one message the
        embedder cannot take never blocks the backlog (issue 31, item 2).  When all
        fail alone and a plain probe sentence fails too, the embedder itself is
        broken: the batch's error is raised and nothing is set aside.

        Returns:
            The messages embedded and their vectors, in the same order.
        """
        texts = [self.embedding_text(m) for m in batch]
        try:
            return batch, self.embedder.embed(texts)
        except Exception as error:  # a poison message or a broken embedder: see which
            kept, vectors, failures = self._embed_one_by_one(batch, texts)
            if not kept and not self._embedder_works():
                raise error
        if not failures:  # the batch failed as a whole (its size, say), its messages did not
            return kept, vectors
        for message_id, reason in failures.items():
            log.warning("message %d set aside from embedding: %s (it stays stored and "
                        "keyword-searchable; an edit, another model or `reembed` tries it "
                        "again)", message_id, reason)
        self.storage.backlog.set_aside(failures, model=self.embedder.model_id)
        return kept, vectors

    def _embed_one_by_one(
        self, batch: list[PendingMessage], texts: list[str]
    ) -> tuple[list[PendingMessage], np.ndarray, dict[int, str]]:
        kept: list[PendingMessage] = []
        rows: list[np.ndarray] = []
        failures: dict[int, str] = {}
        for message, text in zip(batch, texts):
            try:
                rows.append(self.embedder.embed([text])[0])
                kept.append(message)
            except Exception as exc:  # recorded as the reason it is set aside
                failures[message.id] = f"{type(exc).__name__}: {str(exc)[:200]}"
        vectors = np.stack(rows) if rows else np.zeros((0, self.embedder.dimension), np.float32)
        return kept, vectors, failures

    def _embedder_works(self) -> bool:
        try:
            self.embedder.embed(["a plain sentence to check the embedder"])
        except Exception:  # the caller raises the batch's own error
            return False
        return True

    def embedding_text(self, message: PendingMessage) -> str:
        """The text embedded for a message, per the profile's ``[embedder] context`` setting."""
        cfg = self.config
        with_antecedent = needs_antecedent(message.content, cfg.context, cfg.short_words)
        return embedding_text(
            message.author_name,
            message.content,
            message.attachments,
            message.antecedent_author if with_antecedent else None,
            message.antecedent_content if with_antecedent else None,
        )

    def reembed(self, *, progress: Progress | None = None) -> int:
        """Embed every message again with the current embedder, then swap the vectors in.

        The new vectors fill a table beside the live one, which searches keep using
        until the swap (:class:`~memory.storage.contract.VectorRebuild`); a run that
        stops before it is carried on by the next.  It also rebuilds a damaged vector
        table from the stored text, and tries again every message set aside earlier.
        Returns how many messages were embedded.
        """
        model, dimension = self.embedder.model_id, self.embedder.dimension
        self.storage.backlog.retry_set_aside()  # every message gets another chance
        rebuild = self.storage.rebuild
        if rebuild.start(model, dimension):
            log.info("carrying on the re-embedding an earlier run began")
        done = 0
        for _ in range(2):  # the second pass: messages changed while the first ran
            after = 0
            while batch := rebuild.pending(after, EMBED_CHUNK):
                embedded, vectors = self._embed_batch(batch)  # failures are set aside
                done += rebuild.write(embedded, vectors)
                after = batch[-1].id
                if progress:
                    progress(len(batch))
        rebuild.finish(model, dimension)
        self.storage.meta.model = model
        return done + self.embed_pending(progress=progress)
