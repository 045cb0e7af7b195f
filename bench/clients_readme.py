"""The README's "Works with" table, from bench/results/clients.json (`make test-clients` writes it):
a row per client check (client, version, what was run, result, its numbers), the summary and
each client's install time. `python -m bench.clients_readme` rewrites the README's block."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

RESULTS = Path("bench/results/clients.json")
README = Path("README.md")
BEGIN = "<!-- works-with: bench/clients_readme.py writes this block from bench/results/clients.json -->"
END = "<!-- end of works-with -->"
COLUMNS = ("client", "version", "what was run", "result", "numbers")


def _numbers(numbers: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in numbers.items()) or "—"


def _row(cells) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |\n"


def block(doc: dict) -> str:
    rows = _row(COLUMNS) + _row(["---"] * len(COLUMNS)) + "".join(_row((
        c["client"], c["version"] or "—", c["ran"], c["result"], _numbers(c["numbers"]))) for c in doc["clients"])
    cfg = doc["config"]
    installs = ", ".join(f"{name} {s:.0f} s" for name, s in doc["install_s"].items())
    text = textwrap.fill(f"The committed run ({cfg['date']}, {cfg['machine']}; {cfg['model']} on {cfg['stack']}): "
                         f"{doc['summary']}.", 96, break_on_hyphens=False) + f"\n\n{rows}"
    if installs:
        text += "\n" + textwrap.fill(f"Each client's venv installed in: {installs}.", 96) + "\n"
    return f"{BEGIN}\n{text}{END}"


def current() -> str:
    assert RESULTS.exists(), f"no {RESULTS}: run `make test-clients`"
    return block(json.loads(RESULTS.read_text()))


def write() -> None:
    text = README.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    README.write_text(text[:start] + current() + text[end:])


if __name__ == "__main__":
    write()
