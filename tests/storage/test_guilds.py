"""The settings version: one cheap read tells a process whether any guild's settings changed.

Run once per storage engine (``tests/storage/conftest.py``).  Several bot processes
share one database (shards spread over processes); each caches guild settings and
drops its cache when this number moves, so the change must move it whichever
process made it, in the change's own transaction.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from memory.errors import SettingsError
from memory.records import MessageRecord
from memory.storage import Storage, open_storage
from tests.support.builders import GUILD

OTHER_GUILD = GUILD + 1


@pytest.mark.parametrize("change", [
    {"channel_mode": "include"},
    {"add_channel": 5},
    {"remove_channel": 5},
    {"retention_days": 30},
    {"retention_days": None},
    {"autoresponse": "off"},
    {"toggle_autoresponse_channel": 6},
    {"opt_out": 7},
    {"opt_in": 7},
])
def test_every_settings_change_moves_the_version(storage: Storage, change: dict) -> None:
    before = storage.guilds.settings_version()
    storage.guilds.update_settings(GUILD, **change)
    assert storage.guilds.settings_version() != before


def test_the_version_is_zero_before_any_change_and_reads_change_nothing(storage: Storage) -> None:
    assert storage.guilds.settings_version() == 0
    storage.guilds.settings(GUILD)
    storage.guilds.retention_cutoffs()
    assert storage.guilds.settings_version() == 0


def test_forget_me_and_forgetting_a_guild_move_it(
    storage: Storage, make_record: Callable[..., MessageRecord]
) -> None:
    """Forget-me opts the member out; a forgotten guild's settings are gone: both are changes."""
    storage.messages.upsert([make_record("hello there", author_id=7),
                             make_record("elsewhere", guild_id=OTHER_GUILD, channel_id=OTHER_GUILD + 1)])
    first = storage.guilds.settings_version()
    storage.forgetting.forget_member(GUILD, 7)
    second = storage.guilds.settings_version()
    assert second != first and 7 in storage.guilds.settings(GUILD).opted_out
    storage.forgetting.forget_guild(OTHER_GUILD)
    assert storage.guilds.settings_version() not in (first, second)


def test_a_refused_change_leaves_the_version(storage: Storage) -> None:
    storage.guilds.update_settings(GUILD, channel_mode="exclude")
    before = storage.guilds.settings_version()
    with pytest.raises(SettingsError):
        storage.guilds.update_settings(GUILD, channel_mode="sometimes")
    assert storage.guilds.settings_version() == before


def test_another_process_sees_the_change(storage: Storage, tmp_db: str) -> None:
    """A second storage on the same database stands for another bot process."""
    other = open_storage(tmp_db)
    try:
        seen = other.guilds.settings_version()
        storage.guilds.update_settings(GUILD, opt_out=9)
        assert other.guilds.settings_version() != seen
        assert 9 in other.guilds.settings(GUILD).opted_out
    finally:
        other.close()


def test_forgetting_a_guild_drops_its_reconcile_progress(
    storage: Storage, make_record: Callable[..., MessageRecord]
) -> None:
    """A guild the bot left keeps no trace, reconcile's run and cursors included: SQLite's
    table list lacked them while PostgreSQL's had them (drift found in issue 34's refactor)."""
    channel = OTHER_GUILD + 1
    storage.messages.upsert([make_record("elsewhere", guild_id=OTHER_GUILD, channel_id=channel)])
    storage.guilds.begin_reconcile_run(OTHER_GUILD, 1_000)
    storage.guilds.save_reconcile_cursor(OTHER_GUILD, channel, 1_000, 123)
    storage.guilds.begin_reconcile_run(GUILD, 2_000)  # another guild's run stays
    storage.forgetting.forget_guild(OTHER_GUILD)
    assert storage.guilds.reconcile_run(OTHER_GUILD) is None
    assert storage.guilds.reconcile_cursor(channel) is None
    assert storage.guilds.reconcile_run(GUILD) == 2_000
