"""The product's size conventions (docs/ARCHITECTURE.md, "Code — conventions"), checked: no
function in pdserve/ over 50 lines, no file over 400 and no class over 300.
(ruff's C901, PLR0913 and PLR0915 hold the rest.) And Redis
is reached through pdserve/shared/state/ alone: no module outside it uses the raw client (`state.r`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("pdserve",)
MAX_FUNCTION_LINES = 50
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 300



def product_files() -> list[Path]:
    return sorted(p for top in PRODUCT for p in (ROOT / top).rglob("*.py"))


def name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def lines(node: ast.AST) -> int:
    """From its `def` or `class` line to its last (decorators not counted)."""
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined, operator]


def definitions(kind: type | tuple[type, ...]) -> list[tuple[str, int]]:
    """Every definition of `kind` in the product, as ("path:qualified.name", lines)."""
    found = []
    for path in product_files():
        def walk(node: ast.AST, prefix: str, path: Path = path) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    qualified = f"{prefix}{child.name}"
                    if isinstance(child, kind):
                        found.append((f"{name(path)}:{qualified}", lines(child)))
                    walk(child, f"{qualified}.")
                else:
                    walk(child, prefix)
        walk(ast.parse(path.read_text(), str(path)), "")
    return found


def test_product_is_found():
    assert len(product_files()) > 50 and any(n.endswith("Relay") for n, _ in definitions(ast.ClassDef))


def test_no_function_over_50_lines():
    over = [f"{where} ({n} lines)" for where, n in definitions((ast.FunctionDef, ast.AsyncFunctionDef))
            if n > MAX_FUNCTION_LINES]
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split each into named steps): {', '.join(over)}"


def test_no_file_over_400_lines():
    sizes = {name(p): len(p.read_text().splitlines()) for p in product_files()}
    over = [f"{f} ({n} lines)" for f, n in sizes.items() if n > MAX_FILE_LINES]
    assert not over, f"files over {MAX_FILE_LINES} lines (split each by purpose): {', '.join(over)}"


def test_no_class_over_300_lines():
    over = [f"{where} ({n} lines)" for where, n in definitions(ast.ClassDef) if n > MAX_CLASS_LINES]
    assert not over, f"classes over {MAX_CLASS_LINES} lines: {', '.join(over)}"



def test_the_raw_redis_client_stays_inside_shared_state():
    """The subjects' methods, or the core's `script` / `pipelined` / `call` for keys a module
    owns (the prefix index, the gateway's limits): never the client itself."""
    raw = re.compile(r"\bstate\.r\b")
    found = [name(p) for top in (*PRODUCT, "bench", "scripts") for p in (ROOT / top).rglob("*.py")
             if not name(p).startswith("pdserve/shared/state/") and raw.search(p.read_text())]
    assert not found, f"the raw Redis client used outside pdserve/shared/state/: {', '.join(found)}"
