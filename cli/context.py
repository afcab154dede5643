"""What every command shares: the global settings, the profile and engine they open."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memory.config import ConfigError, Profile, load_profile
from memory.engine import MemoryEngine
from memory.errors import MemoryBotError
from memory.storage.postgres.connection import is_postgres_url

ROOT = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    """The bundled sample data: ``data/`` in a checkout, ``cli/data`` in an installed wheel."""
    installed = Path(__file__).resolve().parent / "data"
    return installed if installed.is_dir() else ROOT / "data"


def default_db() -> Path | str:
    """``$MEMORY_DB``, else ``data/memory.sqlite3`` in a checkout, else ``./memory.sqlite3``.

    A ``postgresql://`` URL stays text (a ``Path`` would fold its ``//``).
    """
    if os.environ.get("MEMORY_DB"):
        value = os.environ["MEMORY_DB"]
        return value if is_postgres_url(value) else Path(value)
    checkout = ROOT / "data"
    return checkout / "memory.sqlite3" if (ROOT / "pyproject.toml").is_file() else Path(
        "memory.sqlite3")


@dataclass
class Settings:
    """The global options every command receives."""

    db: Path | str  # an SQLite file, or a postgresql:// URL
    profile: str | None


def resolve_profile(settings: Settings, stored: str | None = None) -> Profile:
    """The profile named on the command line, else the stored one, else ``cpu``.

    Raises:
        ConfigError: The profile cannot be loaded (one the database chose says so).
    """
    if settings.profile or not stored:
        return load_profile(settings.profile or "cpu")
    try:
        return load_profile(stored)
    except ConfigError as exc:
        raise ConfigError(f"the database names profile {stored!r}, chosen with /memory-owner "
                          f"profile, which cannot be loaded ({exc}); pick one with --profile") from None


def profile_storage_url(profile: str) -> str:
    """The ``[storage] url`` of the profile named with ``--profile`` (``""``: none)."""
    return load_profile(profile).storage.url


def open_engine(settings: Settings, db: Path | str | None = None, **kwargs: Any) -> MemoryEngine:
    """Open the engine on ``db`` (default ``--db``) with the resolved profile."""
    from memory.storage import open_storage

    path = db or settings.db
    stored = None
    if is_postgres_url(path) or Path(path).exists():
        storage = open_storage(path)
        stored = storage.meta.active_profile
        storage.close()
    return MemoryEngine(path, resolve_profile(settings, stored), **kwargs)


def require_db(path: Path | str) -> None:
    """Refuse to create a database where the command only reads one.

    A PostgreSQL database exists on its server already (opening it says if it cannot).

    Raises:
        MemoryBotError: ``path`` does not exist.
    """
    if not is_postgres_url(path) and not Path(path).exists():
        raise MemoryBotError(f"{path} does not exist yet; run `python bot.py import ...` first")
