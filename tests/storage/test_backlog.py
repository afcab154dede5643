"""The embedding backlog: crash-safe, claimed by concurrent embedders, never writing a
vector for text that changed or went while it was embedded; antecedents."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest

import memory.embedding
from memory.engine import MemoryEngine
from memory.records import MessageRecord
from memory.storage import Storage, claims
from memory.text import EMBED_CHARS
from tests.support.builders import GUILD, HashEmbedder
from tests.support.inspection import Inspector
from tests.support.storage import row_counts, stored_vector

MakeRecord = Callable[..., MessageRecord]
ROOT = Path(__file__).resolve().parents[2]
Inspect = Callable[[Storage], Inspector]


class CrashingEmbedder(HashEmbedder):
    """Embeds ``good_calls`` batches, then fails like a killed process would."""

    def __init__(self, good_calls: int) -> None:
        super().__init__()
        self.good_calls = good_calls

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if self.calls >= self.good_calls:
            raise RuntimeError("embedder crashed")
        return super().embed(texts)


def test_backlog_survives_an_embedder_crash(
    make_engine: Callable[..., MemoryEngine],
    make_record: MakeRecord,
    tmp_db: str,
    monkeypatch: pytest.MonkeyPatch,
    inspector: Inspect,
) -> None:
    monkeypatch.setattr(memory.embedding, "EMBED_CHUNK", 10)
    records = [make_record(f"backlog message {i}") for i in range(25)]
    crashing = make_engine(tmp_db, CrashingEmbedder(good_calls=1))
    with pytest.raises(RuntimeError, match="crashed"):
        crashing.ingest(records)
    # every message was stored before embedding began; the first chunk's vectors persist
    assert crashing.storage.messages.count() == 25
    assert crashing.storage.backlog.pending_count() == 15
    assert row_counts(crashing.storage, inspector) == {"messages": 25, "fts": 25, "vectors": 10}
    first_chunk = sorted(r.id for r in records)[:10]
    assert all(stored_vector(crashing.storage, mid) is not None for mid in first_chunk)
    crashing.close()

    resumed = make_engine(tmp_db, HashEmbedder())  # the next run
    assert resumed.embed_pending() == 15
    assert resumed.storage.backlog.pending_count() == 0
    assert row_counts(resumed.storage, inspector)["vectors"] == 25


def test_messages_are_stored_even_if_the_first_batch_fails(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord
) -> None:
    engine = make_engine(embedder=CrashingEmbedder(good_calls=0))
    with pytest.raises(RuntimeError):
        engine.ingest([make_record("hello there"), make_record("general kenobi")])
    assert engine.storage.messages.count() == 2
    assert engine.storage.backlog.pending_count() == 2
    # keyword search still finds them while the vectors are missing
    result = engine.search("kenobi", guild_id=GUILD, mode="keyword")
    assert len(result.hits) == 1


def test_edit_during_embedding_does_not_leave_a_stale_vector(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    # The interleaving of a background embed with a Discord edit event, step by step.
    record = make_record("the meeting is on tuesday")
    engine.storage.messages.upsert([record])
    engine.storage.meta.bind_model(engine.embedder.model_id, engine.embedder.dimension)
    batch = engine.storage.backlog.pending(10)
    vectors = engine.embedder.embed([engine.embedding_text(m) for m in batch])
    # the edit lands
    engine.storage.messages.upsert([replace(record, content="the meeting is on thursday")])
    engine.storage.backlog.write_vectors(batch, vectors)  # the embed of the old text finishes
    assert stored_vector(engine.storage, record.id) is None
    assert engine.storage.backlog.pending_count() == 1
    assert engine.embed_pending() == 1
    (fresh,) = engine.embedder.embed(
        [engine.embedding_text(replace(batch[0], content="the meeting is on thursday"))])
    np.testing.assert_allclose(stored_vector(engine.storage, record.id), fresh, atol=1e-6)


def test_delete_during_embedding_leaves_no_orphan_vector(
    engine: MemoryEngine, make_record: MakeRecord, inspector: Inspect
) -> None:
    keep, gone = make_record("keep me"), make_record("delete me")
    engine.storage.messages.upsert([keep, gone])
    engine.storage.meta.bind_model(engine.embedder.model_id, engine.embedder.dimension)
    batch = engine.storage.backlog.pending(10)
    vectors = engine.embedder.embed([engine.embedding_text(m) for m in batch])
    engine.forget_messages([gone.id])  # the delete lands while the batch is being embedded
    engine.storage.backlog.write_vectors(batch, vectors)
    assert row_counts(engine.storage, inspector) == {"messages": 1, "fts": 1, "vectors": 1}
    assert stored_vector(engine.storage, gone.id) is None
    assert engine.storage.backlog.pending_count() == 0


def test_pending_uses_reply_target_or_previous_message_as_antecedent(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    question = make_record("does anyone have a spare soldering iron", age_days=3)
    chatter = make_record("lunch was great", age_days=2)
    answer = make_record("yes mine", age_days=1, reply_to_id=question.id, author_id=2)
    follow = make_record("thanks", age_days=0.5)
    engine.storage.messages.upsert([question, chatter, answer, follow])
    pending = {p.id: p for p in engine.storage.backlog.pending(10)}
    assert pending[answer.id].antecedent_content == question.content
    assert pending[follow.id].antecedent_content == answer.content  # previous in channel
    assert pending[question.id].antecedent_content is None
    assert "soldering iron" in engine.embedding_text(pending[answer.id])


class CountingEmbedder(HashEmbedder):
    """Counts every text it embeds; pauses a moment per batch so embedders interleave.

    With ``meet``, its first batch waits there until every embedder sharing the
    barrier holds a batch too: under load one thread could otherwise claim the whole
    backlog before the other starts (the CI flake "both embedders took part").
    """

    def __init__(self, meet: threading.Barrier | None = None) -> None:
        super().__init__()
        self.texts: list[str] = []
        self._lock = threading.Lock()
        self._meet = meet

    def embed(self, texts):
        with self._lock:
            self.texts.extend(texts)
        if self._meet is not None:
            meet, self._meet = self._meet, None
            meet.wait(timeout=120)  # a broken barrier fails the test, never hangs it
        time.sleep(0.005)
        return super().embed(texts)


def test_claims_split_the_backlog_between_embedders(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    engine.storage.messages.upsert([make_record(f"note {i}") for i in range(10)])
    first = engine.storage.backlog.claim(6, owner="a")
    second = engine.storage.backlog.claim(6, owner="b")
    assert len(first) == 6 and len(second) == 4
    assert not {m.id for m in first} & {m.id for m in second}
    assert engine.storage.backlog.claim(6, owner="c") == []
    engine.storage.backlog.release("b")
    assert {m.id for m in engine.storage.backlog.claim(6, owner="c")} == {m.id for m in second}
    # an expired claim (its embedder died) is free again
    assert len(engine.storage.backlog.claim(6, owner="d", ttl_s=0)) == 0
    engine.storage.backlog.release("a")
    assert len(engine.storage.backlog.claim(6, owner="d", ttl_s=0)) == 6
    assert len(engine.storage.backlog.claim(6, owner="e")) == 6


def test_a_write_whose_claim_was_taken_over_is_skipped(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    engine.storage.messages.upsert([make_record("slow embedder's message")])
    engine.storage.meta.bind_model(engine.embedder.model_id, engine.embedder.dimension)
    mine = engine.storage.backlog.claim(1, owner="slow", ttl_s=0)  # expires at once
    theirs = engine.storage.backlog.claim(1, owner="fast")
    assert [m.id for m in theirs] == [m.id for m in mine]
    engine.storage.backlog.write_vectors(mine, engine.embedder.embed(["x"]), owner="slow")
    # left to the embedder that holds the claim
    assert engine.storage.backlog.pending_count() == 1
    engine.storage.backlog.write_vectors(theirs, engine.embedder.embed(["x"]), owner="fast")
    assert engine.storage.backlog.pending_count() == 0


def test_two_embedders_never_embed_the_same_message(
    make_engine, make_record: MakeRecord, make_location: Callable[[str], str], inspector: Inspect
) -> None:
    """Two engines (two connections, as two processes would have) share one backlog;
    afterwards the vector statistics (SQLite: code_stats) equal a recount of the stored
    vectors."""
    db = make_location("shared")
    records = [make_record(f"message {i} about the garden") for i in range(1500)]
    records += [make_record(f"other guild {i}", guild_id=GUILD + 1) for i in range(300)]
    make_engine(db).storage.messages.upsert(records)
    meet = threading.Barrier(2)
    embedders = [CountingEmbedder(meet), CountingEmbedder(meet)]
    engines = [make_engine(db, embedder) for embedder in embedders]
    errors: list[BaseException] = []

    def run(engine: MemoryEngine) -> None:
        try:
            engine.embed_pending()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(e,)) for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    embedded = [t for e in embedders for t in e.texts]
    assert len(embedded) == len(records)  # nobody repeated anybody's work
    assert all(e.texts for e in embedders), "both embedders took part"
    storage = engines[0].storage
    assert storage.backlog.pending_count() == 0
    inspector(storage).check_vector_statistics()
    # deletes and edits subtract their old codes
    storage.forgetting.forget_messages([r.id for r in records[:100]])
    edited = replace(records[200], content="an edited message about bicycles")
    engines[0].ingest([edited])
    inspector(storage).check_vector_statistics()


def test_a_claim_is_never_empty_while_unclaimed_messages_remain(
    make_engine, make_record: MakeRecord, make_location: Callable[[str], str]
) -> None:
    """An empty claim tells an embedder the backlog is done.  On PostgreSQL a claim
    committed after another's read could take every row that read chose, and the
    second claim came back empty with thousands left: its embedder stopped early."""
    db = make_location("shared")
    make_engine(db).storage.messages.upsert(make_record(f"m {i}") for i in range(3000))
    engines = [make_engine(db) for _ in range(3)]
    left_at_empty: list[int] = []

    def claim_all(engine: MemoryEngine) -> None:
        owner = claims.process_owner()
        while engine.storage.backlog.claim(16, owner=owner):
            pass
        probe = engines[2].storage.backlog.claim(1, owner=claims.process_owner())
        left_at_empty.append(len(probe))  # unclaimed messages remained when it said none

    threads = [threading.Thread(target=claim_all, args=(e,)) for e in engines[:2]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert left_at_empty == [0, 0]


class BlockingEmbedder(HashEmbedder):
    """Once armed, holds its next batch until the test releases it, so a change lands
    mid-embed; records every text embedded while armed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.started = threading.Event()
        self.release = threading.Event()
        self.texts: list[str] = []

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not self.armed:
            return super().embed(texts)
        self.texts.extend(texts)
        if not self.started.is_set():
            self.started.set()
            assert self.release.wait(30), "the test never released the embedder"
        return super().embed(texts)


def _remove_antecedent(engine: MemoryEngine, antecedent: MessageRecord, how: str) -> None:
    if how == "delete":
        engine.forget_messages([antecedent.id])
    elif how == "edit":
        engine.storage.messages.upsert([replace(antecedent, content="nothing to see here")])
    elif how == "forget-me":
        engine.forget_member(GUILD, antecedent.author_id)
    elif how == "retention":
        engine.forget_older_than(GUILD, datetime.fromtimestamp(
            (antecedent.created_at + 3_600_000) / 1000, tz=timezone.utc))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["delete", "edit", "forget-me", "retention"])
@pytest.mark.parametrize("embedding_handle", ["same", "second"])
def test_a_vector_is_never_written_from_an_antecedent_removed_mid_embed(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: str,
    how: str, embedding_handle: str,
) -> None:
    """Issue 30.2: a short line is embedded with its antecedent's text; when that text is
    deleted, edited or forgotten while the pass that read it runs, the neighbour's vector
    must not keep it, whichever storage handle (process) embeds."""
    blocking = BlockingEmbedder()
    engine = make_engine(tmp_db, blocking)
    embedding = make_engine(tmp_db, blocking) if embedding_handle == "second" else engine
    secret = make_record("the vault code is pineapple", author_id=7, age_days=3)
    engine.ingest([secret])
    short = make_record("agreed", author_id=2, age_days=1)
    engine.storage.messages.upsert([short])
    blocking.armed = True
    errors: list[BaseException] = []

    def run() -> None:
        try:
            embedding.embed_pending()
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert blocking.started.wait(30)
    assert "pineapple" in blocking.texts[0]  # the pass read the antecedent
    _remove_antecedent(engine, secret, how)
    blocking.release.set()
    thread.join(30)
    assert errors == []
    # the neighbour went back to the backlog and was embedded again from current text
    assert engine.storage.backlog.pending_count() == 0
    assert not any("pineapple" in text for text in blocking.texts[1:])
    last = [text for text in blocking.texts if text.startswith("User2:")][-1]
    assert "pineapple" not in last
    stored = stored_vector(engine.storage, short.id)
    assert stored is not None
    np.testing.assert_allclose(stored, HashEmbedder().embed([last])[0], atol=1e-6)


@pytest.mark.parametrize("how", ["delete", "edit"])
def test_a_message_stored_in_between_takes_over_as_antecedent(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: str, how: str
) -> None:
    """A short line embedded with the message before it as antecedent; then a catch-up,
    backfill or import stores a message posted in between.  The line is embedded again
    with its new antecedent, so deleting or editing the old one later leaves no trace
    of it in the line's vector (the old antecedent is no longer the line's neighbour)."""
    engine = make_engine(tmp_db)
    secret = make_record("the vault code is pineapple", author_id=7, age_days=3)
    between = make_record("posted while the bot was away", author_id=3, age_days=2)
    short = make_record("agreed", author_id=2, age_days=1)
    engine.ingest([secret])
    engine.ingest([short])
    assert "pineapple" in _embedded_text(engine, short.id)
    engine.ingest([between])  # stored after ``short``, with a smaller id
    assert "pineapple" not in _embedded_text(engine, short.id)
    _remove_antecedent(engine, secret, how)
    engine.embed_pending()
    assert engine.storage.backlog.pending_count() == 0
    text = _embedded_text(engine, short.id)
    assert "posted while the bot was away" in text
    stored = stored_vector(engine.storage, short.id)
    assert stored is not None
    np.testing.assert_allclose(stored, HashEmbedder().embed([text])[0], atol=1e-6)


def test_storing_at_the_end_of_a_channel_embeds_nothing_again(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    """Live capture stores each message after the others: nothing goes back to the backlog."""
    engine.ingest([make_record(f"message number {i}", age_days=3 - i / 10) for i in range(5)])
    engine.storage.messages.upsert([make_record("the newest one", age_days=0.5)])
    assert engine.storage.backlog.pending_count() == 1


def _embedded_text(engine: MemoryEngine, message_id: int) -> str:
    """The text a message's vector is (or would now be) made from."""
    return engine.embedding_text(engine.storage.backlog.messages([message_id])[0])


CLAIMER_ON_ANOTHER_HOST = """
import sys, time
from memory.storage import claims, open_storage
claims._HOST = "pod-before-the-reschedule"  # the container that was killed had another name
storage = open_storage(sys.argv[1])
batch = storage.backlog.claim(int(sys.argv[2]), owner=claims.process_owner())
print(len(batch), flush=True)
time.sleep(600)
"""


def test_a_killed_embedder_from_another_host_name_is_finished_by_the_next_run(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: str
) -> None:
    """Issue 31.6: after ``kill -9`` the container comes back with a new host name; the
    very next embed finishes the dead one's claimed batch, not 600 s later."""
    engine = make_engine(tmp_db, CountingEmbedder())
    engine.storage.messages.upsert([make_record(f"message {i} of the import") for i in range(300)])
    child = subprocess.Popen([sys.executable, "-c", CLAIMER_ON_ANOTHER_HOST, tmp_db, "256"],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "256"
        assert engine.embed_pending() == 300 - 256  # a live claimer's batch is left alone
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert engine.embed_pending() == 256  # the very next run
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert engine.storage.backlog.pending_count() == 0
    assert len(engine.embedder.texts) == len(set(engine.embedder.texts)) == 300  # each once


def test_an_embedder_reads_a_few_thousand_characters_of_a_huge_message(
    engine: MemoryEngine, make_record: MakeRecord
) -> None:
    """Issue 31.2: the backlog hands the embedder at most EMBED_CHARS of a message (and
    of its antecedent), whatever it holds; the stored text stays whole."""
    huge = make_record("start " + "x" * 3_000_000, attachments=tuple(f"f{i}.png" for i in range(9000)))
    reply = make_record("ok", age_days=0.5)
    engine.storage.messages.upsert([huge, reply])
    pending = {m.id: m for m in engine.storage.backlog.pending(10)}
    assert len(pending[huge.id].content) == EMBED_CHARS and pending[huge.id].content.startswith("start ")
    assert len("\n".join(pending[huge.id].attachments)) <= EMBED_CHARS
    assert len(pending[reply.id].antecedent_content or "") == EMBED_CHARS
    assert engine.embed_pending() == 2
    assert engine.storage.messages.hydrate([huge.id])[huge.id].content == huge.content


class PoisonedEmbedder(HashEmbedder):
    """Fails on any batch holding a text with ``poison`` in it, as a tokenizer running
    out of memory on one message would; ``seen`` lists every text it was given."""

    def __init__(self, poison: str = "poison", model_id: str | None = None) -> None:
        super().__init__(model_id=model_id)
        self.poison = poison
        self.seen: list[str] = []

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.seen.extend(texts)
        if any(self.poison in text for text in texts):
            raise MemoryError("the tokenizer ran out of memory")
        return super().embed(texts)


def test_a_message_the_embedder_fails_on_is_set_aside_not_retried_for_ever(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord, tmp_db: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 31.2: one message that makes the embedder fail no longer blocks the backlog;
    it is set aside with a logged reason, stays stored and keyword-searchable, and an
    edit, another model or a reembed tries it again."""
    embedder = PoisonedEmbedder()
    engine = make_engine(tmp_db, embedder)
    records = [make_record(f"note {i} about the garden", age_days=2 - i / 100) for i in range(20)]
    bad = make_record("a poison pill about the garden shed", age_days=1.5)
    engine.storage.messages.upsert([*records, bad])
    with caplog.at_level(logging.WARNING, logger="memory.embedding"):
        assert engine.embed_pending() == 20  # the batch went through; one of it set aside
    assert f"message {bad.id} set aside from embedding: MemoryError" in caplog.text
    backlog = engine.storage.backlog
    assert backlog.pending_count() == 0 and backlog.set_aside_count() == 1
    (aside,) = backlog.set_aside_messages()
    assert (aside.message_id, aside.model) == (bad.id, embedder.model_id)
    assert "ran out of memory" in aside.reason
    assert engine.storage.stats().set_aside_embeddings == 1
    assert all(stored_vector(engine.storage, r.id) is not None for r in records)
    hits = engine.search("shed", guild_id=GUILD, mode="keyword").hits
    assert [h.id for h in hits] == [bad.id]  # not lost: stored and keyword-searchable
    embedder.seen.clear()
    assert engine.embed_pending() == 0 and embedder.seen == []  # not tried again and again
    # an edit tries it again
    engine.storage.messages.upsert([replace(bad, content="a poison pill, edited")])
    assert backlog.set_aside_count() == 0 and backlog.pending_count() == 1
    assert engine.embed_pending() == 0 and backlog.set_aside_count() == 1
    # so do another model and a reembed
    other = make_engine(tmp_db, PoisonedEmbedder(poison="nothing matches", model_id="test/other"),
                        check_model=False)
    assert other.reembed() == 21 and other.storage.backlog.set_aside_count() == 0
    assert engine.reembed() == 20 and backlog.set_aside_count() == 1
    engine.forget_messages([bad.id])  # a deleted message leaves the list too
    assert backlog.set_aside_count() == 0


def test_a_broken_embedder_sets_nothing_aside(
    make_engine: Callable[..., MemoryEngine], make_record: MakeRecord
) -> None:
    """When every message fails alone and a plain sentence fails too, the embedder is
    at fault, not the messages: the error is raised, nothing is set aside."""
    engine = make_engine(embedder=PoisonedEmbedder(poison=""))  # "" is in every text
    engine.storage.messages.upsert([make_record("one"), make_record("two")])
    with pytest.raises(MemoryError):
        engine.embed_pending()
    assert engine.storage.backlog.set_aside_count() == 0
    assert engine.storage.backlog.pending_count() == 2
