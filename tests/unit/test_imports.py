"""Which part of the repository imports which, read from the source (ast): the product
(pdserve/services/, pdserve/shared/, pdserve/local/) imports neither the planner nor the benchmarks;
the planner imports the product, never the benchmarks; bench/ may import everything."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from pdserve.services import cli

ROOT = Path(__file__).resolve().parents[2]
# each folder, and the packages none of its modules imports
FORBIDDEN = {"pdserve/services": {"bench", "pdserve.planner"}, "pdserve/shared": {"bench", "pdserve.planner"},
             "pdserve/local": {"bench", "pdserve.planner"}, "pdserve/planner": {"bench"}}


def package(module: str) -> str:
    """A module's package as FORBIDDEN names it: pdserve's parts by their second name, others by their first."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "pdserve" else parts[0]


def imported(path: Path) -> set[str]:
    """The packages `path` imports (absolute imports, at any depth in the module)."""
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops |= {package(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(package(node.module))
    return tops


def test_every_part_of_the_package_is_held():
    parts = {p.relative_to(ROOT).as_posix() for p in (ROOT / "pdserve").iterdir() if (p / "__init__.py").exists()}
    assert parts == set(FORBIDDEN)


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_module_imports_what_its_folder_may_not(folder):
    found = {p.relative_to(ROOT).as_posix(): sorted(imported(p) & FORBIDDEN[folder])
             for p in sorted((ROOT / folder).rglob("*.py"))}
    assert (ROOT / folder / "__init__.py").exists()
    assert not {p: tops for p, tops in found.items() if tops}


def test_the_command_reaches_the_planner_by_name_only():
    """`pdserve plan` hands its arguments to pdserve.planner.plan, imported when the command runs (the
    module named in pdserve/services/cli.FORWARDED), not by an import statement of pdserve/services/."""
    assert cli.FORWARDED["plan"] == "pdserve.planner.plan"
    assert importlib.util.find_spec(cli.FORWARDED["plan"]) is not None


def test_test_files_have_unique_names():
    """pytest imports test files by their base name (no packages under tests/): two files of
    one name in different folders stop the whole run at collection."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def module_imports(folder: Path) -> dict[str, set[str]]:
    """Each module of `folder` (dotted) -> the modules of `folder` it imports (TYPE_CHECKING ones too)."""
    mods = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in folder.rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found |= {m for m in (node.module, *(f"{node.module}.{a.name}" for a in node.names)) if m in mods}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in mods}
        graph[name] = found - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each module that reaches itself, with the modules on the way (a
    depth-first search from every module; small graphs)."""
    found = []
    for start in sorted(graph):
        seen, todo = set(), [(start, [start])]
        while todo:
            node, path = todo.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    found.append(path)
                elif nxt not in seen:
                    seen.add(nxt)
                    todo.append((nxt, [*path, nxt]))
    return found


@pytest.mark.parametrize("service", sorted(p.name for p in (ROOT / "pdserve" / "services").iterdir()
                                           if p.is_dir() and (p / "__init__.py").exists()))
def test_no_import_circle_within_a_service(service):
    assert circles(module_imports(ROOT / "pdserve" / "services" / service)) == []


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"], ["b", "c", "a"],
                                                                         ["c", "a", "b"]]


def loaded_at_import(module: str) -> set[str]:
    """The modules importing `module` loads: its top-level imports (not those inside functions or under
    `if TYPE_CHECKING`), followed through pdserve's own modules."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = ROOT / Path(*name.split(".")).with_suffix(".py")
        if not path.exists():
            path = path.with_suffix("") / "__init__.py"
        if not name.startswith("pdserve.") or not path.exists():
            continue
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module, *(f"{node.module}.{a.name}" for a in node.names)] \
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            parents = {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 1)}
            todo += [n for n in (*names, *parents) if n not in seen]
    return seen


@pytest.mark.parametrize("service", ["router", "gateway"])
def test_the_router_and_the_gateway_import_without_torch(service):
    """The router places requests from numbers, the gateway reads a model's architecture and
    tokenizer (pdserve/shared/engine/sources.py): neither imports torch, transformers or xgrammar at
    start (each costs seconds and hundreds of MB; a gateway's GGUF architecture is read through
    transformers' mapping when it starts, a grammar compiled when one is asked for)."""
    loaded = {m.split(".")[0] for m in loaded_at_import(f"pdserve.services.{service}.main")}
    assert not loaded & {"torch", "transformers", "xgrammar"}
