"""The PostgreSQL engine against a real server: what only a server engine must show.

The contract itself is tested for both engines by ``tests/storage/``; here: opening
and migrating (several processes at once), URLs and errors, the locks that keep
concurrent writers in order, which server errors a write may simply run again, claims that die with a killed process, and the keyword
index agreeing with FTS5's tokenizer.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from memory.errors import DatabaseFileError, StorageBusy
from memory.filters import Filters
from memory.records import MessageRecord
from memory.storage import open_storage, tokens
from memory.storage.postgres import PostgresStorage
from memory.storage.postgres.connection import is_postgres_url, redact
from memory.storage.postgres.database import GUILD_LOCKS
from memory.storage.postgres.keywords import query_words, term_frequencies
from tests.support.builders import BASE_MS, CHANNEL, GUILD, snowflake
from tests.support.postgres import PostgresServer, database_name
from tests.support.postgres_inspection import PostgresInspector

pytestmark = pytest.mark.postgres


def _record(i: int, content: str, **fields: object) -> MessageRecord:
    created = BASE_MS + i * 60_000
    base: dict[str, object] = dict(
        id=snowflake(created, i), guild_id=GUILD, channel_id=CHANNEL, author_id=7,
        created_at=created, content=content, author_name="zoe", author_display_name="Zoë",
        guild_name="Guild", channel_name="general")
    base.update(fields)
    return MessageRecord(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("url", "expected"), [
    ("postgresql://bot:s3cret@db.example:5432/memory", "postgresql://bot:***@db.example:5432/memory"),
    ("postgres://bot@db/memory", "postgres://bot@db/memory"),
    ("postgresql:///memory?host=/run/postgresql", "postgresql:///memory?host=/run/postgresql"),
    ("postgresql://bot@db/memory?password=hunter2&sslmode=require",
     "postgresql://bot@db/memory?password=***&sslmode=require"),
    ("postgresql://bot@db/memory?host=/run/pg&SSLPassword=k3y", "postgresql://bot@db/memory?host=/run/pg&SSLPassword=***"),
])
def test_a_url_is_shown_without_its_password(url: str, expected: str) -> None:
    assert is_postgres_url(url)
    assert redact(url) == expected


@pytest.mark.parametrize("location", ["data/memory.sqlite3", "C:/memory.db", "mysql://x/y", ":memory:"])
def test_only_postgresql_urls_pick_the_server_engine(location: str) -> None:
    assert not is_postgres_url(location)


def test_opening_migrates_once_and_reopening_keeps_the_rows(postgres_url: Callable[..., str]) -> None:
    url = postgres_url(migrated=False)
    storage = PostgresStorage(url)
    version = storage.database.schema_version()
    storage.messages.upsert([_record(1, "hello pizza world")])
    storage.close()
    again = PostgresStorage(url)
    assert again.database.schema_version() == version
    assert again.messages.count() == 1
    again.close()


def _open_and_count(url: str, start: float) -> int:
    time.sleep(max(0.0, start - time.time()))
    storage = PostgresStorage(url)
    try:
        return storage.database.schema_version()
    finally:
        storage.close()


def test_processes_opening_a_new_database_at_once_migrate_it_once(
    postgres_url: Callable[..., str], postgres_server: PostgresServer
) -> None:
    url = postgres_url(migrated=False)
    start = time.time() + 1.0
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        versions = pool.starmap(_open_and_count, [(url, start)] * 4)
    assert len(set(versions)) == 1
    with postgres_server.connect(database_name(url)) as conn:
        applied = [row[0] for row in conn.execute("SELECT version FROM schema_migrations ORDER BY 1")]
    assert applied == list(range(1, versions[0] + 1))


def test_another_applications_database_is_left_alone(postgres_url: Callable[..., str],
                                                      postgres_server: PostgresServer) -> None:
    url = postgres_url(migrated=False)
    name = database_name(url)
    with postgres_server.connect(name) as conn:
        conn.execute("CREATE TABLE invoices (id int)")
    with pytest.raises(DatabaseFileError, match="another application's tables"):
        PostgresStorage(url)
    with postgres_server.connect(name) as conn:
        assert conn.execute("SELECT to_regclass('messages')").fetchone()[0] is None


def test_an_unreachable_server_is_one_clear_line(postgres_server: PostgresServer) -> None:
    with pytest.raises(DatabaseFileError, match="cannot connect to postgresql://bot:\\*\\*\\*@"):
        PostgresStorage("postgresql://bot:pw@127.0.0.1:1/memory?connect_timeout=2")


def test_a_read_only_storage_refuses_writes_and_still_searches(postgres_url: Callable[..., str]) -> None:
    url = postgres_url()
    writer = PostgresStorage(url)
    writer.messages.upsert([_record(1, "pizza oven repair")])
    writer.close()
    reader = PostgresStorage(url, read_only=True)
    try:
        assert [mid for mid, _ in reader.keywords.ranked(["pizza"], 5, Filters())] == [
            snowflake(BASE_MS + 60_000, 1)]
        with pytest.raises(DatabaseFileError, match="read-only"):
            reader.messages.upsert([_record(2, "more")])
    finally:
        reader.close()


@pytest.mark.parametrize(("text", "words"), [
    ("Café RUNNING", ["cafe", "run"]),
    ("state-of-the-art", ["state", "of", "the", "art"]),
    ("東京タワー 東京", ["東京タワー", "東京"]),
    ("https://foo.com/bar", ["http", "foo", "com", "bar"]),
    ('"AND" OR NEAR(*)', ["and", "or", "near"]),
    ("", []),
])
def test_query_words_are_fts5s_tokens(text: str, words: list[str]) -> None:
    assert query_words([text]) == words


def test_message_documents_weigh_attachments_half_and_count_every_token() -> None:
    [(terms, length, window, window_length)] = term_frequencies([("Zoë zoe", "pizza pizza party", "pizza.png", "a b")])
    assert terms == {"zoe": 2.0, "pizza": 2.5, "parti": 1.0, "png": 0.5}
    assert length == 7
    assert (window, window_length) == ({"a": 1, "b": 1}, 2)


def _kill_after_claim(url: str, ready: multiprocessing.Event) -> None:  # type: ignore[valid-type]
    storage = PostgresStorage(url)
    storage.backlog.claim(3, owner="doomed", ttl_s=3600)
    ready.set()
    time.sleep(600)


def test_a_killed_embedders_claims_come_back_at_once(postgres_url: Callable[..., str]) -> None:
    url = postgres_url()
    storage = PostgresStorage(url)
    storage.messages.upsert([_record(i, f"message number {i}") for i in range(5)])
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_kill_after_claim, args=(url, ready))
    child.start()
    try:
        assert ready.wait(60)
        assert len(storage.backlog.claim(10, owner="alive")) == 2  # three are the child's
        storage.backlog.release("alive")
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    deadline = time.time() + 10
    while (got := len(storage.backlog.claim(10, owner="after"))) < 5 and time.time() < deadline:
        storage.backlog.release("after")  # the server may take a moment to end the session
        time.sleep(0.2)
    assert got == 5  # the killed process's three, long before their hour is up
    storage.close()


def test_two_claimers_never_share_a_message(postgres_url: Callable[..., str]) -> None:
    storage = PostgresStorage(postgres_url())
    storage.messages.upsert([_record(i, f"message number {i}") for i in range(50)])
    first = {m.id for m in storage.backlog.claim(30, owner="a")}
    second = {m.id for m in storage.backlog.claim(30, owner="b")}
    assert len(first) == 30 and len(second) == 20 and not first & second
    storage.close()


def _with_vectors(url: str, count: int, rng: np.random.Generator,
                  ) -> tuple[PostgresStorage, list[MessageRecord], np.ndarray]:
    """A storage holding ``count`` messages over 50 channels, each with a random 16-d
    vector (the matrix's rows, in the records' order)."""
    storage = PostgresStorage(url)
    records = [_record(i, f"message {i}", channel_id=CHANNEL + i % 50) for i in range(count)]
    storage.messages.upsert(records)
    storage.meta.bind_model("test/random", 16)
    storage.meta.model = "test/random"
    batch = storage.backlog.pending(count)
    assert [message.id for message in batch] == [record.id for record in records]
    matrix = rng.normal(size=(count, 16))
    storage.backlog.write_vectors(batch, matrix)
    return storage, records, matrix


def test_vectors_found_through_filters_inside_the_knn(postgres_url: Callable[..., str]) -> None:
    rng = np.random.default_rng(0)
    storage, records, _ = _with_vectors(postgres_url(), 500, rng)
    query = rng.normal(size=16)
    # one channel of fifty: the walk must go on past the unfiltered neighbours
    found = storage.vectors.knn(query, 10, Filters(guild_id=GUILD, channel_ids=(CHANNEL + 3,)))
    assert len(found) == 10
    assert {r.channel_id for r in records if r.id in dict(found)} == {CHANNEL + 3}
    storage.close()


def _errors() -> list[tuple[BaseException, bool]]:
    import psycopg
    import psycopg_pool
    from psycopg import errors

    return [
        (errors.DeadlockDetected("deadlock detected"), True),
        (errors.SerializationFailure("could not serialize access"), True),
        (errors.LockNotAvailable("canceling statement due to lock timeout"), True),
        (errors.AdminShutdown("terminating connection due to administrator command"), True),
        (errors.ConnectionFailure("connection failure"), True),
        (psycopg.OperationalError("server closed the connection unexpectedly"), True),
        (psycopg_pool.PoolTimeout("couldn't get a connection after 30.00 sec"), True),
        (errors.UniqueViolation("duplicate key value"), False),
        (errors.QueryCanceled("canceling statement due to statement timeout"), False),
        (errors.InsufficientPrivilege("permission denied for table messages"), False),
        (ValueError("not a database error"), False),
    ]


def test_the_retryable_server_errors_are_storage_busy() -> None:
    from memory.storage.postgres.connection import as_busy

    for exc, retryable in _errors():
        busy = as_busy(exc, "postgresql://bot:pw@db/memory")
        assert (busy is not None) == retryable, exc
        if busy is not None:
            assert isinstance(busy, StorageBusy) and "pw" not in str(busy)


def _waiting_on_messages(server: PostgresServer, name: str) -> bool:
    with server.connect(name) as conn:
        return bool(conn.execute("SELECT count(*) FROM pg_locks WHERE NOT granted AND "
                                 "relation = 'messages'::regclass").fetchone()[0])


def test_a_deadlock_resolved_against_a_write_is_storage_busy(
    postgres_url: Callable[..., str], postgres_server: PostgresServer
) -> None:
    """A real deadlock: the upsert holds its guild's lock and waits for ``messages``; the
    other session holds ``messages`` and asks for the guild's lock.  The server aborts
    the upsert (it waited first, so its deadlock check runs first)."""
    url = postgres_url()
    storage = PostgresStorage(url)
    other = postgres_server.connect(database_name(url))
    outcome: list[BaseException | None] = []
    try:
        other.execute("BEGIN")
        other.execute("LOCK TABLE messages IN EXCLUSIVE MODE")

        def write() -> None:
            try:
                storage.messages.upsert([_record(1, "caught in a deadlock")])
                outcome.append(None)
            except BaseException as exc:  # handed to the test thread
                outcome.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        deadline = time.time() + 30
        while not _waiting_on_messages(postgres_server, database_name(url)):
            assert time.time() < deadline
            time.sleep(0.05)
        other.execute("SELECT pg_advisory_xact_lock(%s, %s)", (GUILD_LOCKS, GUILD % 2_147_483_647))
        other.execute("COMMIT")
        writer.join(30)
        assert isinstance(outcome[0], StorageBusy) and "deadlock" in str(outcome[0])
        assert storage.messages.upsert([_record(1, "caught in a deadlock")]).inserted == 1
    finally:
        other.close()
        storage.close()


def test_a_write_on_a_lost_connection_is_storage_busy_and_the_next_one_works(
    postgres_url: Callable[..., str], postgres_server: PostgresServer
) -> None:
    url = postgres_url()
    storage = PostgresStorage(url)
    try:
        storage.messages.upsert([_record(1, "before the server restarts")])
        with postgres_server.connect("postgres") as admin:  # what a restart or fail-over does
            killed = admin.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                   "WHERE datname = %s AND pid <> pg_backend_pid()",
                                   (database_name(url),)).fetchone()[0]
        assert killed >= 1
        with pytest.raises(StorageBusy):
            storage.messages.upsert([_record(2, "while the connection is gone")])
        assert storage.messages.upsert([_record(2, "while the connection is gone")]).inserted == 1
        assert storage.messages.count() == 2
    finally:
        storage.close()


_VOCABULARY = ("kayak pizza oven router violin tax chess moss comet ferry quilt lemon badge "
               "garden running runner café cafe naïve tomato compost server cluster deploy "
               "weekend meeting tickets concert museum").split()


def _chat(count: int, seed: int) -> list[MessageRecord]:
    """Messages with Zipf-like word use, two guilds, replies, attachments, two authors'
    names that are words too (the author column is searched)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / (np.arange(len(_VOCABULARY)) + 2.0)
    weights /= weights.sum()
    records = []
    for i in range(count):
        words = rng.choice(_VOCABULARY, size=int(rng.integers(1, 12)), p=weights)
        author = int(rng.integers(1, 6))
        records.append(_record(
            i, " ".join(words), guild_id=GUILD + i % 2, channel_id=CHANNEL + i % 3,
            author_id=author, author_name=f"user{author}",
            author_display_name=["Moss", "Comet", "Zoë", "Ann", "Bo"][author - 1],
            attachments=("map.png",) if i % 11 == 0 else (),
            reply_to_id=snowflake(BASE_MS + (i - 3) * 60_000, i - 3) if i % 7 == 0 and i > 3 else None))
    return records


def test_keyword_rankings_equal_sqlites_fts5(
    postgres_url: Callable[..., str], tmp_path: Path
) -> None:
    """The same documents give the same BM25 scores, hence the same lists, on both engines:
    both fields, filters, rare and common words, several words, words that match nothing."""
    records = _chat(600, seed=3)
    engines = [open_storage(str(tmp_path / "memory.sqlite3")), PostgresStorage(postgres_url())]
    try:
        for storage in engines:
            storage.messages.upsert(records)
            storage.forgetting.forget_messages([records[5].id, records[40].id])
        queries = [["kayak"], ["moss", "comet"], ["running"], ["naive", "cafe"], ["map"],
                   ["pizza", "oven", "router", "violin"], ["zoe"], ["absent"], ["tomato", "nothing"]]
        filters = [Filters(), Filters(guild_id=GUILD), Filters(guild_id=GUILD + 1,
                   channel_ids=(CHANNEL, CHANNEL + 2)), Filters(author_ids=(2, 3)),
                   Filters(has_attachment=True), Filters(after_ms=BASE_MS + 200 * 60_000)]
        for words in queries:
            for where in filters:
                for field in ("message", "window"):
                    lists = [storage.keywords.ranked(words, 1000, where, field=field)
                             for storage in engines]
                    assert dict(lists[0]).keys() == dict(lists[1]).keys(), (words, where, field)
                    for mid, score in lists[0]:
                        assert dict(lists[1])[mid] == pytest.approx(score, rel=1e-9, abs=1e-12)
                    top = [storage.keywords.ranked(words, 10, where, field=field)
                           for storage in engines]
                    np.testing.assert_allclose([s for _, s in top[0]], [s for _, s in top[1]],
                                               rtol=1e-9)
            assert engines[0].keywords.term_counts(words) == engines[1].keywords.term_counts(words)
    finally:
        for storage in engines:
            storage.close()


def test_migration_3_moves_jsonb_documents_to_postings(
    postgres_url: Callable[..., str], postgres_server: PostgresServer
) -> None:
    """A database written before the postings (each document a JSONB object of its words)
    gets them from those objects: the same rankings, every total recounted."""
    url = postgres_url()
    storage = PostgresStorage(url)
    storage.messages.upsert(_chat(300, seed=5))
    before = {(words, field): storage.keywords.ranked([words], 50, Filters(guild_id=GUILD),
                                                      field=field)
              for words in ("kayak", "moss", "pizza") for field in ("message", "window")}
    storage.close()
    with postgres_server.connect(database_name(url)) as conn:  # back to schema version 2
        for table, postings in (("keyword_messages", "message_postings"),
                                ("keyword_windows", "window_postings")):
            conn.execute(f"ALTER TABLE {table} ADD COLUMN terms jsonb NOT NULL DEFAULT '{{}}'")
            conn.execute(f"UPDATE {table} d SET terms = p.terms FROM (SELECT id, "
                         f"jsonb_object_agg(term, tf) AS terms FROM {postings} GROUP BY id) p "
                         "WHERE p.id = d.id")
            conn.execute(f"CREATE INDEX {table}_terms ON {table} USING gin (terms)")
        conn.execute("DROP TABLE message_postings, window_postings, keyword_terms")
        conn.execute("DELETE FROM schema_migrations WHERE version >= 3")
    again = PostgresStorage(url)
    try:
        assert again.database.schema_version() >= 3
        PostgresInspector(url).check_keyword_index()
        for (words, field), ranked in before.items():
            found = again.keywords.ranked([words], 50, Filters(guild_id=GUILD), field=field)
            assert ranked and [m for m, _ in found] == [m for m, _ in ranked]
    finally:
        again.close()


def test_migration_10_cuts_the_long_words_an_older_version_stored(
    postgres_url: Callable[..., str], postgres_server: PostgresServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A word of 241-2,700 bytes was stored whole: its documents are written again with
    it cut, so the query (cut the same way) finds it and every total stays right."""
    url = postgres_url()
    word = "k" * 400
    monkeypatch.setattr(tokens, "MAX_TERM_BYTES", 2_600)  # as an older version stored it
    storage = PostgresStorage(url)
    storage.messages.upsert([_record(1, f"the key is {word}"), _record(2, "no key here"),
                             _record(3, "near the key")])
    storage.close()
    with postgres_server.connect(database_name(url)) as conn:
        assert conn.execute("SELECT count(*) FROM message_postings WHERE "
                            "octet_length(term) = 400").fetchone() == (1,)
        conn.execute("DELETE FROM schema_migrations WHERE version >= 10")
    monkeypatch.undo()
    again = PostgresStorage(url)
    try:
        assert again.database.schema_version() >= 10
        with postgres_server.connect(database_name(url)) as conn:
            assert conn.execute(
                "SELECT max(octet_length(term)) FROM (SELECT term FROM message_postings UNION "
                "ALL SELECT term FROM window_postings UNION ALL SELECT term FROM keyword_terms) t"
            ).fetchone() == (tokens.MAX_TERM_BYTES,)
        PostgresInspector(url).check_keyword_index()
        found = again.keywords.ranked([word], 5, Filters(guild_id=GUILD))
        assert [m for m, _ in found] == [_record(1, "").id]
    finally:
        again.close()


def _graphs(server: PostgresServer, url: str) -> dict[str, list[str] | None]:
    """Each HNSW index on ``message_vectors`` and the build options it was made with."""
    with server.connect(database_name(url)) as conn:
        return dict(conn.execute(
            "SELECT c.relname, c.reloptions FROM pg_index i JOIN pg_class c ON c.oid = "
            "i.indexrelid JOIN pg_am a ON a.oid = c.relam WHERE i.indrelid = "
            "'message_vectors'::regclass AND a.amname = 'hnsw' AND i.indisvalid").fetchall())


def test_migration_4_rebuilds_a_default_graph_denser(
    postgres_url: Callable[..., str], postgres_server: PostgresServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A new database gets the denser graph; one an older version built with pgvector's
    defaults is rebuilt once, and its HNSW search (a guild past exact KNN) still finds
    the nearest vectors."""
    url = postgres_url()
    rng = np.random.default_rng(4)
    storage, records, matrix = _with_vectors(url, 4200, rng)
    storage.close()
    assert _graphs(postgres_server, url) == {
        "message_vectors_hnsw_halfvec": ["m=24", "ef_construction=128"]}
    with postgres_server.connect(database_name(url)) as conn:  # as versions before 4 built it
        conn.execute("ALTER INDEX message_vectors_hnsw_halfvec RESET (m, ef_construction)")
        conn.execute("REINDEX INDEX message_vectors_hnsw_halfvec")
        conn.execute("DELETE FROM schema_migrations WHERE version >= 4")
    assert _graphs(postgres_server, url) == {"message_vectors_hnsw_halfvec": None}
    with caplog.at_level("WARNING", logger="memory.storage.postgres.migrations"):
        again = PostgresStorage(url)
    try:
        assert again.database.schema_version() >= 4
        assert _graphs(postgres_server, url) == {
            "message_vectors_hnsw_halfvec": ["m=24", "ef_construction=128"]}
        assert "message_vectors_hnsw_halfvec over 4200 vectors" in caplog.text
        again.meta.model = "test/random"
        ids = [record.id for record in records]
        unit = matrix / np.linalg.norm(matrix, axis=1, keepdims=True)
        for query in rng.normal(size=(5, 16)):
            exact = {ids[i] for i in np.argsort(-(unit @ query))[:10]}
            found = {message_id for message_id, _ in again.vectors.knn(query, 10, Filters(guild_id=GUILD))}
            assert len(found & exact) >= 8
    finally:
        again.close()
    PostgresStorage(url).close()  # opened again: nothing left to rebuild
    assert caplog.text.count("rebuilding the vector index") == 1
