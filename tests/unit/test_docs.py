"""The docs a reader uses: a short README, a short ARCHITECTURE navigable by `###` with no
section too long, present tense about the repository alone (no working sessions, no paths outside it),
and relative links that resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
SECTION_MAX = 80
ARCHITECTURE_MAX = 900


def _prose(text: str) -> str:
    """The text without code blocks and inline code (where `session_id`, a field's name, may appear)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_doc_mentions_sessions_or_paths_outside_the_repository(doc):
    text = doc.read_text()
    assert "../shared" not in text
    assert not re.findall(r"(?i)\bsessions?\b", _prose(text)), [
        ln for ln in text.splitlines() if re.search(r"(?i)\bsessions?\b", _prose(ln))]


def test_architecture_has_a_section_per_contract_none_too_long():
    lines = ARCHITECTURE.read_text().splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith("#")]
    assert sum(lines[i].startswith("### ") for i in heads) >= 20
    long = [(lines[a], b - a) for a, b in zip(heads, heads[1:] + [len(lines)]) if b - a > SECTION_MAX]
    assert not long, long


def test_architecture_is_short():
    assert len(ARCHITECTURE.read_text().splitlines()) <= ARCHITECTURE_MAX


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.name}: {target}"
        if anchor and file.suffix == ".md":
            anchors = {_anchor(ln.lstrip("#")) for ln in file.read_text().splitlines() if ln.startswith("#")}
            assert anchor in anchors, f"{doc.name}: {target}"
