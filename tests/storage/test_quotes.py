"""What the bot's public answers quote, and the answers due to be taken down.

Run once per storage engine (``tests/storage/conftest.py``).  Every way a stored
message is forgotten — and an edit that changes its text — makes the answers quoting
it due, in the forgetting's own transaction; an answer quoting other messages is left
alone, and a guild the bot left takes its answers' rows with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from memory.records import MessageRecord
from memory.storage import Storage
from memory.storage.contract import PostedAnswer
from tests.support.builders import BASE_MS, CHANNEL, GUILD

OTHER_GUILD = GUILD + 1
ASIDE = CHANNEL + 1  # the forgotten message's channel
DAY_MS = 86_400_000


def answer(answer_id: int, guild_id: int = GUILD, channel_id: int = CHANNEL) -> PostedAnswer:
    return PostedAnswer(answer_id, channel_id, guild_id)


@pytest.fixture
def quoted(storage: Storage, make_record: Callable[..., MessageRecord]) -> dict[str, MessageRecord]:
    """``gone`` (author 7, in ``ASIDE``, 30 days old) is what each test forgets; ``kept``
    (author 8, in ``CHANNEL``, a day old) stays.  Answer 1 quotes both, answer 2 ``kept``
    alone."""
    records = {"gone": make_record("the raid password is swordfish", author_id=7,
                                   channel_id=ASIDE, age_days=30),
               "kept": make_record("the raid is on saturday", author_id=8),
               "unquoted": make_record("nobody quoted this", author_id=8)}
    storage.messages.upsert(records.values())
    due = storage.quotes.record([(answer(1), [records["gone"].id, records["kept"].id]),
                                 (answer(2), [records["kept"].id])])
    assert due == [] and storage.quotes.due() == []
    return records


def _edited(storage: Storage, record: MessageRecord, text: str) -> None:
    storage.messages.upsert([replace(record, content=text, edited_at=BASE_MS + 1)])


FORGET_PATHS: dict[str, Callable[[Storage, dict[str, MessageRecord]], object]] = {
    "single delete": lambda s, r: s.forgetting.forget_messages([r["gone"].id]),
    "bulk delete": lambda s, r: s.forgetting.forget_messages([r["gone"].id, r["unquoted"].id]),
    "forget-me": lambda s, r: s.forgetting.forget_member(GUILD, 7),
    "channel deleted or purged": lambda s, r: s.forgetting.forget_channels([ASIDE]),
    "retention": lambda s, r: s.forgetting.forget_older_than(GUILD, BASE_MS - 10 * DAY_MS),
    "emptying edit": lambda s, r: s.forgetting.forget_emptied({r["gone"].id: BASE_MS + 1}),
    "text edited": lambda s, r: _edited(s, r["gone"], "the password changed, never mind"),
    "edit after opting out": lambda s, r: (s.guilds.update_settings(GUILD, opt_out=7),
                                           _edited(s, r["gone"], "edited after opting out")),
}


@pytest.mark.parametrize("forget", FORGET_PATHS.values(), ids=FORGET_PATHS.keys())
def test_every_way_a_quoted_message_goes_makes_its_answers_due(
    storage: Storage, quoted: dict[str, MessageRecord], forget: Callable
) -> None:
    forget(storage, quoted)
    assert storage.quotes.due() == [answer(1)], "answer 2 quotes only what stays"
    storage.forgetting.forget_messages([quoted["unquoted"].id])
    assert storage.quotes.due() == [answer(1)], "an unrelated deletion retracts nothing more"
    storage.quotes.retracted([1])
    assert storage.quotes.due() == []
    storage.forgetting.forget_messages([quoted["kept"].id])
    assert storage.quotes.due() == [answer(2)], "answer 1's quote rows left with it"


def test_an_edit_that_keeps_the_text_retracts_nothing(
    storage: Storage, quoted: dict[str, MessageRecord]
) -> None:
    storage.messages.upsert([replace(quoted["gone"], edited_at=BASE_MS + 1)])  # same text
    assert storage.quotes.due() == []


def test_an_answer_quoting_a_message_gone_before_it_was_recorded_is_due_at_once(
    storage: Storage, make_record: Callable[..., MessageRecord]
) -> None:
    here, gone = make_record("still here"), make_record("deleted meanwhile")
    storage.messages.upsert([here, gone])
    storage.forgetting.forget_messages([gone.id])
    assert storage.quotes.record([(answer(5), [here.id, gone.id]), (answer(6), [here.id])]) == [5]
    assert storage.quotes.due() == [answer(5)]
    assert storage.quotes.record([(answer(6), [here.id])]) == [], "recording again changes nothing"
    storage.forgetting.forget_messages([here.id])
    assert storage.quotes.due() == [answer(5), answer(6)]


def test_an_answer_quoting_a_message_edited_since_the_question_is_due_at_once(
    storage: Storage, make_record: Callable[..., MessageRecord]
) -> None:
    """The search read the old text; the edit was applied before the answer was
    recorded, so no quote row was there for it to make the answer due."""
    old, edited = make_record("the raid password is swordfish"), make_record("untouched")
    storage.messages.upsert([old, edited])
    asked = BASE_MS + 10  # the question, then the search read the text
    storage.messages.upsert([replace(old, content="never mind", edited_at=asked + 5)])
    assert storage.quotes.record([(answer(11), [old.id, edited.id]), (answer(12), [edited.id])],
                                 edited_since=asked) == [11]
    assert storage.quotes.due() == [answer(11)]
    storage.messages.upsert([replace(edited, content="later", edited_at=asked - 1)])
    assert storage.quotes.due() == [answer(11), answer(12)], "answer 12 was recorded"


def test_an_answer_deleted_on_discord_takes_its_rows_with_it(
    storage: Storage, quoted: dict[str, MessageRecord]
) -> None:
    """A moderator deleted the answer (its deletion event forgets its id): nothing is
    left to take down, so its quote rows do not wait for a quoted message to go."""
    storage.forgetting.forget_messages([2])
    storage.forgetting.forget_messages([quoted["gone"].id])
    storage.forgetting.forget_messages([1])  # already due
    assert storage.quotes.due() == []
    storage.forgetting.forget_messages([quoted["kept"].id])
    assert storage.quotes.due() == [], "answer 2's rows went with it"


def test_the_answers_of_a_guild_the_bot_left_are_dropped_not_due(
    storage: Storage, make_record: Callable[..., MessageRecord]
) -> None:
    ours, theirs = make_record("in the guild it leaves"), make_record(
        "in another guild", guild_id=OTHER_GUILD, channel_id=OTHER_GUILD + 1)
    storage.messages.upsert([ours, theirs])
    storage.quotes.record([(answer(7), [ours.id]),
                           (answer(8, OTHER_GUILD, OTHER_GUILD + 1), [theirs.id])])
    storage.forgetting.forget_messages([ours.id])  # due, then the bot leaves
    storage.quotes.record([(answer(9), [ours.id])])  # due at once
    assert [a.answer_id for a in storage.quotes.due()] == [7, 9]
    storage.forgetting.forget_guild(GUILD)
    assert storage.quotes.due() == []
    storage.forgetting.forget_messages([theirs.id])
    assert storage.quotes.due() == [answer(8, OTHER_GUILD, OTHER_GUILD + 1)]
    assert storage.quotes.due(guild_ids=[OTHER_GUILD]) == storage.quotes.due()
    assert storage.quotes.due(guild_ids=[GUILD]) == [], "another process's guilds are its own"


def test_due_answers_come_oldest_first_within_the_limit(
    storage: Storage, make_record: Callable[..., MessageRecord]
) -> None:
    record = make_record("quoted three times")
    storage.messages.upsert([record])
    storage.quotes.record([(answer(i), [record.id]) for i in (30, 10, 20)])
    storage.forgetting.forget_messages([record.id])
    assert [a.answer_id for a in storage.quotes.due(limit=2)] == [10, 20]
    storage.quotes.retracted([10, 20, 999])
    assert [a.answer_id for a in storage.quotes.due()] == [30]
