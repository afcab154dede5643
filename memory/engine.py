"""The memory engine: one object the CLI and the Discord cog talk to.

It composes the storage (:mod:`memory.storage`), the embedder, the searcher and the
active reranker, and does what takes more than one of them: ingest and import (store,
then embed), embed the backlog and re-embed (:mod:`memory.embedding`), search,
retrieve context for a chat model, forget, and switch hardware profile.  What needs
the storage alone is asked of it directly: ``engine.storage.<noun>.<method>``
(``engine.storage.guilds.settings(g)``).
Every deletion goes through the engine's ``forget_*`` methods.  Everything here is
synchronous; the cog crosses into a worker thread once, at its boundary.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from memory import retention
from memory.config import Profile
from memory.context import Context, CounterSlot, TokenCounter, assemble_context
from memory.embedder import Embedder, SentenceTransformerEmbedder
from memory.embedding import MessageEmbedder
from memory.errors import EmbeddingModelMismatch, SettingsError
from memory.ingest import ImportSummary, IngestStats, Progress, store_exports
from memory.records import MessageRecord, PendingMessage, SearchResult, datetime_to_ms, ms_to_datetime
from memory.rerank.manager import RerankerManager
from memory.rerank.service import RerankerStatus
from memory.search import Searcher, SearchRequest
from memory.storage import Storage, open_storage

log = logging.getLogger(__name__)


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
        self.embedding = MessageEmbedder(self.storage, self.embedder, profile.embedder)
        if check_model:
            self._check_model()
            self.storage.meta.model = self.embedder.model_id  # a reembed elsewhere is noticed
        self.rerankers = RerankerManager(profile, load=load_reranker)
        self.searcher = Searcher(
            self.storage, self.embedder, profile.search, reranker=self.rerankers.current
        )
        self._token_counter = CounterSlot()

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
        load (nor the first answer for starting the token counter).  A reranker that
        cannot load is logged; searches then run without it.
        """
        self.embedder.embed(["warm-up"])
        self._token_counter.get(self.profile.llm)
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
        """Unload the reranker, stop the searcher's worker and close the database.

        The database is closed even when unloading is cut short (a Ctrl-C while the
        reranker waits for its background compile).
        """
        try:
            self.rerankers.close()
        finally:
            try:
                self.searcher.close()
            finally:
                self._token_counter.close()
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
        summary = store_exports(self.storage.messages, paths, on_file=on_file,
                                forget_emptied=self.storage.forgetting.forget_emptied)
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

    def forget_emptied(self, edits: Mapping[int, int]) -> int:
        """Forget messages an edit left with nothing to store (``{id: edit time}``): a
        copy edited later (text put back) is stored again, an older one never; how many
        stored messages were removed."""
        return self.storage.forgetting.forget_emptied(edits)

    def forget_channels(self, channel_ids: Iterable[int]) -> int:
        """Forget every message of these channels and their threads."""
        return self.storage.forgetting.forget_channels(channel_ids)

    def forget_guild(self, guild_id: int) -> int:
        """Forget everything from a guild, its settings included (not its opt-outs)."""
        removed = self.storage.forgetting.forget_guild(guild_id)
        self.searcher.members.forget(guild_id)  # no name of it stays in memory either
        return removed

    def forget_member(self, guild_id: int, author_id: int) -> int:
        """Forget a member in one guild: their messages and name, and (opted out) their next ones.

        Returns:
            How many messages were removed.
        """
        removed = self.storage.forgetting.forget_member(guild_id, author_id)
        self.searcher.members.forget(guild_id)
        return removed

    def forget_older_than(self, guild_id: int, cutoff: datetime) -> int:
        """Forget a guild's messages older than ``cutoff`` (its retention period)."""
        return self.storage.forgetting.forget_older_than(guild_id, datetime_to_ms(cutoff))

    def forget_expired(self, guild_id: int, days: int, *, discord_now_ms: int | None = None) -> int:
        """Forget a guild's messages older than ``days``, counted from the retention clock
        (:mod:`memory.retention`): a host clock far ahead does not expire everything.

        Args:
            guild_id: The guild.
            days: Its retention period.
            discord_now_ms: Discord's clock now, from the gateway (``None``: the newest stored message).

        Returns:
            How many messages were removed.

        Raises:
            SettingsError: ``days`` is below 1 (that would forget every message).
        """
        if days < 1:
            raise SettingsError("retention must be a positive number of days")
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
        """Embed every stored message that has no vector yet, in chunks, each in its own
        transaction (:meth:`memory.embedding.MessageEmbedder.embed_pending`).

        Args:
            progress: Called with the size of each chunk written.
            stop: Once set, the run ends after the chunk it is on; the rest stays pending.
            chunk: Messages per step; 0 is :data:`memory.embedding.EMBED_CHUNK`.

        Returns:
            How many messages were embedded (those the embedder failed on are set aside).
        """
        return self.embedding.embed_pending(progress=progress, stop=stop, chunk=chunk)

    def embedding_text(self, message: PendingMessage) -> str:
        """The text embedded for a message, per the profile's ``[embedder] context`` setting."""
        return self.embedding.embedding_text(message)

    def reembed(self, *, progress: Progress | None = None) -> int:
        """Embed every message again with the current embedder, then swap the vectors in
        (:meth:`memory.embedding.MessageEmbedder.reembed`); how many were embedded."""
        return self.embedding.reembed(progress=progress)
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
        """Counts prompt tokens for the chat model (built by :meth:`preload` or on first use)."""
        return self._token_counter.get(self.profile.llm)

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
            self.storage.meta.active_profile = profile.reference
        self.profile = replace(self.profile, reranker=profile.reranker, llm=profile.llm,
                               name=profile.name, source=profile.source)
