"""``bot.py import`` counts every message it read (issue 31, item 8): those left out
because they were deleted before or their author opted out, and those a damaged file
gave before its damage (stored, and embedded with the rest).  On both engines."""

from __future__ import annotations

from pathlib import Path

import pytest

import bot
from memory.storage import open_storage
from tests.engine.test_importer import export, msg

pytestmark = pytest.mark.usefixtures("single_torch_thread")

GUILD = 900
AUTHORS = [{"id": "5", "name": "ann"}, {"id": "6", "name": "bob"}]


def _messages(count: int) -> list[dict]:
    """``count`` messages, alternating between ann and bob."""
    return [msg(10**17 + i, f"note number {i} about the heron", author=AUTHORS[i % 2])
            for i in range(count)]


def _import(capsys: pytest.CaptureFixture, db: str, *args: str) -> tuple[int, str, str]:
    code = bot.main(["--db", db, "--profile", "cpu-fast", "import", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_an_import_counts_what_tombstones_and_opt_outs_kept_out(
    tmp_path: Path, capsys: pytest.CaptureFixture, db_location: str
) -> None:
    path = str(export(tmp_path / "chat.json", _messages(10)))
    code, out, err = _import(capsys, db_location, "--no-embed", path)
    assert code == 0 and "10 new" in out, err
    storage = open_storage(db_location)
    storage.forgetting.forget_messages([10**17 + 0, 10**17 + 2])  # two of ann's, deleted
    storage.guilds.update_settings(GUILD, opt_out=6)  # bob opted out
    storage.close()

    code, out, err = _import(capsys, db_location, "--no-embed", path)

    assert code == 0, err
    assert "0 new, 0 updated, 3 unchanged" in out
    assert "2 deleted before (not stored again)" in out
    assert "5 by members who opted out (not stored)" in out


def test_a_file_damaged_part_way_is_stored_embedded_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture, db_location: str
) -> None:
    path = export(tmp_path / "cut.json", _messages(6))
    text = path.read_text(encoding="utf-8")
    path.write_text(text[:text.index(f'"id": "{10**17 + 4}"')], encoding="utf-8")

    code, out, err = _import(capsys, db_location, str(path))

    assert code == 0, err
    assert out.startswith("1 files (1 unreadable; 1 of them damaged part-way, what came before "
                          "the damage is stored), 4 new"), out
    assert "4 embedded" in out
    assert "cut.json" in err and "after 4 messages" in err
    storage = open_storage(db_location, read_only=True)
    try:
        assert storage.messages.count() == 4 and storage.backlog.pending_count() == 0
    finally:
        storage.close()


def test_a_file_with_nothing_readable_still_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture, db_location: str
) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"guild": {"id": "900"}, "channel": {"id": "901"}, "messages": [{"id": "3"',
                    encoding="utf-8")
    code, _, err = _import(capsys, db_location, "--no-embed", str(path))
    assert code == 2 and "not a readable JSON export" in err
