"""Profiles: TOML files in ``profiles/`` read into a :class:`Profile`, checked as a whole."""

from __future__ import annotations

import dataclasses
import logging
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memory.config.fields import check_value
from memory.config.reranker import RerankerConfig, validate_reranker
from memory.config.sections import (
    EmbedderConfig,
    LLMConfig,
    ReconcileConfig,
    SearchConfig,
    StorageConfig,
)
from memory.errors import ConfigError
from memory.hardware import auto_profile_name
from memory.urls import refuse_url_credentials

log = logging.getLogger(__name__)


def _profiles_dir() -> Path:
    """``profiles/`` in a checkout; ``memory/profiles`` in an installed wheel."""
    memory = Path(__file__).resolve().parent.parent
    installed = memory / "profiles"
    return installed if installed.is_dir() else memory.parent / "profiles"


PROFILES_DIR = _profiles_dir()


@dataclass(frozen=True)
class Profile:
    """A named hardware profile: one config per component."""

    name: str
    embedder: EmbedderConfig = field(default_factory=EmbedderConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    reranker: RerankerConfig = field(default_factory=RerankerConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    source: str = "<defaults>"
    reconcile: ReconcileConfig = field(default_factory=ReconcileConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    @property
    def reference(self) -> str:
        """What :func:`load_profile` loads this profile by again (the choice a database
        stores): its name when it is the shipped file of that name or built in code, else
        its file's absolute path.  A custom ``cpu.toml`` stored as ``cpu`` loaded the
        shipped one at the next start; ``mine.toml`` stored as ``mine`` loaded nothing."""
        if self.source.startswith("<"):
            return self.name
        path = Path(self.source).resolve()
        return self.name if path == (PROFILES_DIR / f"{self.name}.toml").resolve() else str(path)


_SECTIONS = {
    "embedder": EmbedderConfig, "search": SearchConfig, "reranker": RerankerConfig,
    "llm": LLMConfig, "reconcile": ReconcileConfig, "storage": StorageConfig,
}


# Keys older profiles may still carry: renamed (read under the new name) or dropped.
_RETIRED: dict[tuple[str, str], str | None] = {
    ("reranker", "concurrency"): "parallel",
    ("reranker", "health_interval"): None,
    ("search", "member_boost"): None,  # multiplicative boosts gave way to bounded bonuses
    ("search", "multi_query_boost"): "multi_query_bonus",  # one word: "bonus" (issue 22)
    ("search", "recency_min"): None,
    ("search", "recency_max"): None,
}


def _build_section(source: str, section: str, table: Any) -> Any:
    cls = _SECTIONS[section]
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [{section}] must be a table")
    fields = _table_fields(cls)
    values = {}
    for key, value in table.items():
        if (section, key) in _RETIRED:
            new = _RETIRED[section, key]
            log.warning("%s: %s.%s is retired%s", source, section, key,
                        f"; read as {section}.{new}" if new else " and ignored")
            if not new or new in table:
                continue
            key = new
        if key not in fields:
            raise ConfigError(
                f"{source}: unknown key {section}.{key} (known: {', '.join(sorted(fields))})"
            )
        values[key] = check_value(source, f"{section}.{key}", fields[key], value)
    return RerankerConfig.from_table(values) if cls is RerankerConfig else cls(**values)


def _table_fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """The keys a section's table may have; ``[reranker]`` is flat over its backends."""
    if cls is RerankerConfig:
        return RerankerConfig.table_fields()
    return {f.name: f for f in dataclasses.fields(cls)}


def _validate_profile(profile: Profile) -> Profile:
    if not profile.embedder.model.strip():
        raise ConfigError(f"{profile.source}: embedder.model must name a model or a folder")
    s = profile.search
    if s.threshold_floor > s.threshold_start:
        raise ConfigError(f"{profile.source}: search.threshold_floor must be <= threshold_start")
    validate_reranker(profile.source, profile.reranker, profile.llm)
    _validate_llm(profile.source, profile.llm)
    url = profile.storage.url
    if url and not url.startswith(("postgresql://", "postgres://")):
        raise ConfigError(
            f"{profile.source}: storage.url must be a postgresql:// URL (an SQLite file is "
            f"given with --db), got {url.split('@')[-1][:60]!r}"
        )
    return profile


def _validate_llm(source: str, llm: LLMConfig) -> None:
    if not llm.enabled:
        return
    if not llm.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"{source}: llm.base_url must be an http(s) URL, "
                          f"got {llm.base_url.split('@')[-1][:60]!r}")
    refuse_url_credentials("llm.base_url", llm.base_url, source)
    if not llm.model.strip():
        raise ConfigError(
            f"{source}: llm.model is required with llm.base_url (llama-server accepts any name)"
        )


def parse_profile(name: str, data: dict[str, Any], source: str) -> Profile:
    """Build a :class:`Profile` from a parsed TOML document.

    Raises:
        ConfigError: Unknown table or key, wrong type, or out-of-range value.
    """
    sections: dict[str, Any] = {}
    for section, table in data.items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"{source}: unknown table [{section}] (known: {', '.join(_SECTIONS)})"
            )
        sections[section] = _build_section(source, section, table)
    return _validate_profile(Profile(name=name, source=source, **sections))


def load_profile_file(path: str | Path) -> Profile:
    """Load one profile from a TOML file; the profile's name is the file's stem.

    Raises:
        ConfigError: The file is missing, not TOML, or has a bad key or value.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: profile file not found") from None
    except OSError as exc:  # a folder, no permission, ...
        raise ConfigError(f"{path}: cannot read the profile ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_profile(path.stem, data, str(path))


def available_profiles(directory: Path = PROFILES_DIR) -> list[str]:
    """Return the names of the profiles shipped in ``directory``."""
    return sorted(p.stem for p in directory.glob("*.toml"))


def load_profile(name_or_path: str, directory: Path = PROFILES_DIR) -> Profile:
    """Load a profile by name (``cpu``, ``cuda``, ..., or ``auto``) or by file path.

    ``auto`` picks ``cuda``, then ``mps``, then ``cpu`` or ``cpu-small`` (see
    :func:`memory.hardware.auto_profile_name`).

    Raises:
        ConfigError: No such profile, or the file is invalid.
    """
    if name_or_path == "auto":
        name_or_path = auto_profile_name()
        log.info("auto profile picked %s", name_or_path)
    candidate = Path(name_or_path)
    if candidate.suffix == ".toml" or candidate.exists():
        return load_profile_file(candidate)
    path = directory / f"{name_or_path}.toml"
    if not path.exists():
        known = ", ".join(available_profiles(directory)) or "none"
        raise ConfigError(f"unknown profile {name_or_path!r} (available: {known}, auto)")
    return load_profile_file(path)
