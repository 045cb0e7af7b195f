"""docs/RESULTS.md, where every benchmark's generated block lives, and the one way to write one."""

from __future__ import annotations

from pathlib import Path

RESULTS_DOC = Path(__file__).parents[1] / "docs" / "RESULTS.md"


def update_block(path: Path, begin: str, end: str, text: str) -> None:
    """Replace the text between two markers of a document (each benchmark has its own pair)."""
    doc = path.read_text()
    if begin not in doc:
        raise SystemExit(f"{path} has no {begin} marker")
    head, rest = doc.split(begin, 1)
    tail = rest.split(end, 1)[1]
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
