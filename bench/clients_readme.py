"""The "Works with" tables, from bench/results/clients.json (`make test-clients` writes it): the
README's, a row per client (version, what was run, checks passed), and docs/CLIENTS.md's, a row
per check (what was run, result, its numbers) with each client's install time.
`python -m bench.clients_readme` rewrites both blocks."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

RESULTS = Path("bench/results/clients.json")
README = Path("README.md")
DETAIL = Path("docs/CLIENTS.md")
BEGIN = "<!-- works-with: bench/clients_readme.py writes this block from bench/results/clients.json -->"
END = "<!-- end of works-with -->"
COLUMNS = ("client", "version", "what was run", "result", "numbers")
SUMMARY_COLUMNS = ("client", "version", "what was run", "result")


def _numbers(numbers: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in numbers.items()) or "—"


def _row(cells) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |\n"


def detail(doc: dict) -> str:
    """Every check, and the installs (docs/CLIENTS.md)."""
    rows = _row(COLUMNS) + _row(["---"] * len(COLUMNS)) + "".join(_row((
        c["client"], c["version"] or "—", c["ran"], c["result"], _numbers(c["numbers"]))) for c in doc["clients"])
    installs = ", ".join(f"{name} {s:.0f} s" for name, s in doc["install_s"].items())
    text = _headline(doc) + f"\n\n{rows}"
    if installs:
        text += "\n" + textwrap.fill(f"Each client's venv installed in: {installs}.", 96) + "\n"
    return f"{BEGIN}\n{text}{END}"


def block(doc: dict) -> str:
    """A row per client (the README)."""
    clients: dict[str, list[dict]] = {}
    for c in doc["clients"]:
        clients.setdefault(c["client"], []).append(c)
    rows = _row(SUMMARY_COLUMNS) + _row(["---"] * len(SUMMARY_COLUMNS)) + "".join(_row((
        name, checks[0]["version"] or "—", "; ".join(c["ran"] for c in checks),
        f"{sum(c['result'] == 'pass' for c in checks)} of {len(checks)} pass")) for name, checks in clients.items())
    return f"{BEGIN}\n{_headline(doc)}\n\n{rows}{END}"


def _headline(doc: dict) -> str:
    cfg = doc["config"]
    return textwrap.fill(f"The committed run ({cfg['date']}, {cfg['machine']}; {cfg['model']} on {cfg['stack']}): "
                         f"{doc['summary']}.", 96, break_on_hyphens=False)


def current(form=block) -> str:
    assert RESULTS.exists(), f"no {RESULTS}: run `make test-clients`"
    return form(json.loads(RESULTS.read_text()))


def write() -> None:
    for path, form in ((README, block), (DETAIL, detail)):
        text = path.read_text()
        start, end = text.index(BEGIN), text.index(END) + len(END)
        path.write_text(text[:start] + current(form) + text[end:])


if __name__ == "__main__":
    write()
