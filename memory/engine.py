"""The memory engine: one object the CLI and the Discord cog talk to.

It composes the storage (:mod:`memory.storage`), the embedder, the searcher and the
active reranker, and does what takes more than one of them: ingest and import (store,
then embed), embed the backlog, re-embed, search, retrieve context for a chat model,
forget, and switch hardware profile.  What needs the storage alone is asked of it
directly: ``engine.storage.<noun>.<method>`` (``engine.storage.guilds.settings(g)``).
Every deletion goes through the engine's ``forget_*`` methods.  Everything here is
synchronous; the cog crosses into a worker thread once, at its boundary.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import numpy as np

from memory import retention
from memory.config import Profile
from memory.context import Context, TokenCounter, assemble_context, token_counter_for
from memory.embedder import Embedder, SentenceTransformerEmbedder
from memory.errors import EmbeddingModelMismatch
from memory.ingest import ImportSummary, IngestStats, Progress, store_exports
from memory.records import MessageRecord, PendingMessage, SearchResult, datetime_to_ms, ms_to_datetime
from memory.rerank.manager import RerankerManager
from memory.rerank.service import RerankerStatus
from memory.search import Searcher, SearchRequest
from memory.storage import Storage, claims, open_storage
from memory.text import embedding_text, needs_antecedent

log = logging.getLogger(__name__)

EMBED_CHUNK = 256  # messages fetched, encoded and written per step of the backlog


class MemoryEngine:
    """Store, embed and search a Discord server's messages.

    Attributes:
        storage: The database, one attribute per noun (:mod:`memory.storage.contract`).

    Args:
        db_path: Where the database is (an SQLite file, created if missing).
        profile: The hardware profile; each component gets its own section.
        embedder: Override the profile's embedder (tests pass a deterministic fake).
        load_reranker: Start loading the profile's reranker in the background now.
        check_model: Refuse a database embedded with another model (``reembed``
            turns this off because it replaces every vector anyway).

    Raises:
        EmbeddingModelMismatch: The database was embedded with another model.
    """

    def __init__(
        self,
        db_path: str | Path,
        profile: Profile,
        embedder: Embedder | None = None,
        *,
        load_reranker: bool = True,
        check_model: bool = True,
    ) -> None:
        self.profile = profile
        self.storage: Storage = open_storage(db_path)
        self.embedder = embedder or SentenceTransformerEmbedder(profile.embedder)
        if check_model:
            self._check_model()
            self.storage.meta.model = self.embedder.model_id  # a reembed elsewhere is noticed
        self.rerankers = RerankerManager(profile, load=load_reranker)
        self.searcher = Searcher(
            self.storage, self.embedder, profile.search, reranker=self.rerankers.current
        )
        self._token_counter: TokenCounter | None = None

    def _check_model(self) -> None:
        stored = self.storage.meta.embedding_model()
        if stored is not None and stored[0] != self.embedder.model_id:
            raise EmbeddingModelMismatch(
                f"{self.storage.database.location} was embedded with {stored[0]} but the profile "
                f"uses {self.embedder.model_id}; run `python bot.py reembed` to re-embed every "
                "message with the new model"
            )

    def preload(self) -> None:
        """Load the embedder and the reranker now, rather than on the first message or search.

        The bot calls this before it connects, so no event-loop tick pays for a model
        load.  A reranker that cannot load is logged; searches then run without it.
        """
        self.embedder.embed(["warm-up"])
        status = self.reranker_status()
        if status.name is not None and not status.loaded:
            log.warning("searches run without reranking until %s loads: %s",
                        status.name, status.reason)

    def reranker_status(self) -> RerankerStatus:
        """Load the profile's reranker if it is not loaded yet, and say whether searches rerank.

        Returns:
            The backend's name (``None`` without a reranker), whether it loaded, and
            why not.  The caller says the reason; searches that fall back for the
            same reason then log it at debug level only.
        """
        return self.rerankers.status()

    def close(self) -> None:
        """Unload the reranker, stop the searcher's worker and close the database."""
        self.rerankers.close()
        self.searcher.close()
        self.storage.close()

    # -- writes -----------------------------------------------------------------------

    def ingest(
        self, records: Iterable[MessageRecord], *, embed: bool = True,
        progress: Progress | None = None,
    ) -> IngestStats:
        """Store messages, then embed whatever is pending (the new ones and any backlog)."""
        stats = self.storage.messages.upsert(records)
        embedded = self.embed_pending(progress=progress) if embed else 0
        return IngestStats(stats.inserted, stats.updated, stats.unchanged, embedded, stats.expired)

    def import_exports(
        self,
        paths: Iterable[str | Path],
        *,
        embed: bool = True,
        on_file: Progress | None = None,
        on_embedded: Progress | None = None,
    ) -> ImportSummary:
        """Store every DiscordChatExporter file under ``paths``, then embed the backlog.

        Unreadable files are reported in the summary, not raised, so one bad file
        does not stop an import of many (:func:`memory.ingest.store_exports`).

        Raises:
            ImportFormatError: A path does not exist.
        """
        summary = store_exports(self.storage.messages, paths, on_file=on_file)
        if embed:
            summary.embedded = self.embed_pending(progress=on_embedded)
        return summary

    # -- forgetting: the one deletion API -----------------------------------------------

    def forget_messages(self, message_ids: Iterable[int]) -> int:
        """Forget messages everywhere (table, keyword index, vectors); they stay forgotten.

        Returns:
            How many stored messages were removed.
        """
        return self.storage.forgetting.forget_messages(message_ids)

    def forget_channels(self, channel_ids: Iterable[int]) -> int:
        """Forget every message of these channels and their threads."""
        return self.storage.forgetting.forget_channels(channel_ids)

    def forget_guild(self, guild_id: int) -> int:
        """Forget everything from a guild, its settings included."""
        return self.storage.forgetting.forget_guild(guild_id)

    def forget_member(self, guild_id: int, author_id: int) -> int:
        """Forget a member in one guild: their messages and name, and (opted out) their next ones.

        Returns:
            How many messages were removed.
        """
        return self.storage.forgetting.forget_member(guild_id, author_id)

    def forget_older_than(self, guild_id: int, cutoff: datetime) -> int:
        """Forget a guild's messages older than ``cutoff`` (its retention period)."""
        return self.storage.forgetting.forget_older_than(guild_id, datetime_to_ms(cutoff))

    def forget_expired(self, guild_id: int, days: int, *,
                       discord_now_ms: int | None = None) -> int:
        """Forget a guild's messages older than ``days``, counted from the retention
        clock (:mod:`memory.retention`), so that a host clock far ahead does not
        expire everything.

        Args:
            guild_id: The guild.
            days: Its retention period.
            discord_now_ms: Discord's clock now, as the bot measured it from the
                gateway (``None``: not known; the newest stored message vouches).

        Returns:
            How many messages were removed.
        """
        if discord_now_ms is not None:
            now = retention.retention_now(discord_now_ms=discord_now_ms)
        else:
            now = self.storage.guilds.retention_clock()
        host = retention.host_ms()
        if host - now >= retention.SKEW_LOGGED_MS:
            log.warning(
                "retention in guild %d counts from %s, not from the host clock (%s, %.1f days "
                "later): %s; a clock ahead of Discord's must not expire messages, check the "
                "host's time", guild_id, ms_to_datetime(now).isoformat(),
                ms_to_datetime(host).isoformat(), (host - now) / retention.DAY_MS,
                "Discord's clock, measured from the gateway" if discord_now_ms is not None
                else "the newest message stored")
        return self.storage.forgetting.forget_older_than(guild_id, now - days * retention.DAY_MS)

    # -- embedding ----------------------------------------------------------------------

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
        cfg = self.profile.embedder
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

    # -- reads ------------------------------------------------------------------------

    def search(self, request: SearchRequest | str, **options) -> SearchResult:
        """Search memory; a plain string is one query with ``options`` as request fields.

        Raises:
            SearchInputError: The request is malformed.
        """
        if isinstance(request, str):
            request = SearchRequest(queries=(request,), **options)
        elif options:
            request = replace(request, **options)
        return self.searcher.run(request)

    def context_for(
        self,
        query: str,
        scope: SearchRequest | None = None,
        budget_tokens: int | None = None,
        *,
        exclude_ids: Iterable[int] = (),
    ) -> Context:
        """Retrieve conversations about ``query`` to quote to a chat model.

        Args:
            query: The question.
            scope: Guild, filters, limit and the permission allow-list
                (``allowed_channel_ids``); its ``queries`` are ignored.
            budget_tokens: Token budget of the quoted block; the profile's
                ``llm.context_tokens`` by default.
            exclude_ids: Messages never to show (the question itself).

        Returns:
            Windows of messages in time order, numbered for citation, with the trace.

        Raises:
            SearchInputError: The query or scope is malformed.
        """
        return assemble_context(
            self.searcher, self.storage.messages, query, scope,
            budget_tokens or self.profile.llm.context_tokens,
            counter=self.token_counter, exclude_ids=tuple(exclude_ids),
        )

    @property
    def token_counter(self) -> TokenCounter:
        """Counts prompt tokens for the profile's chat model (built on first use)."""
        if self._token_counter is None:
            self._token_counter = token_counter_for(self.profile.llm)
        return self._token_counter

    # -- profiles ---------------------------------------------------------------------

    def switch_profile(self, profile: Profile, *, remember: bool = True) -> Future:
        """Swap to another hardware profile's reranker and remember the choice.

        The new reranker loads in the background; searches keep using the old one
        until the swap, and the old one is unloaded once its in-flight searches end.
        The choice is stored in the database only once the swap happened.  The
        embedder and search settings stay (changing the embedder needs ``reembed``).

        Args:
            profile: The profile to switch to.
            remember: Store the choice (``meta.active_profile``).  A process that
                follows a choice another process stored passes ``False``: writing
                it back could overwrite a newer choice made meanwhile.

        Returns:
            A future resolving to the profile name once active, or raising why not
            (the new reranker failed to load, or storing the choice failed, e.g.
            :class:`~memory.errors.StorageBusy`); then the old profile stays active.
        """
        return self.rerankers.switch(
            profile, on_switched=functools.partial(self._use_profile, remember=remember))

    def _use_profile(self, profile: Profile, *, remember: bool) -> None:
        # the choice is stored first: if that fails (StorageBusy) nothing has changed
        # here, and the reranker manager undoes the swap
        if remember:
            self.storage.meta.active_profile = profile.name
        self.profile = replace(self.profile, reranker=profile.reranker, llm=profile.llm,
                               name=profile.name)
        self._token_counter = None  # the chat model may have changed
