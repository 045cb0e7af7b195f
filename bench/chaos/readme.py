"""The chaos figures of docs/RESULTS.md, from bench/results/chaos.json, chaos-busy.json and
chaos-tls.json (`make chaos`, `make chaos-busy` and `make chaos-tls` write them): a table row per
scenario, and a line each for the run beside a busy neighbour and the run on mutual TLS.
`python -m bench.chaos.readme` rewrites the block from the files."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from bench.results_doc import RESULTS_DOC

RESULTS = Path("bench/results")
BEGIN = "<!-- chaos figures: bench/chaos/readme.py writes this block from bench/results/chaos*.json -->"
END = "<!-- end of chaos figures -->"
STACKS = {"single": "single", "ha": "HA", "hosts": "hosts", "outage": "fake model, small NATS buffer"}
COLUMNS = ("stack", "fault", "lost / mismatched / leaked", "recovery (s)", "extra load time (s)", "streams moved",
           "moved streams recovered (s)", "prompts recomputed on a decode worker",
           "survivors' ITL p99 during / before", "during / same window without the fault")


def _cell(value) -> str:
    return "—" if value is None else str(value)


def line(title: str, run: dict | None) -> str:
    """A run's scenarios in a sentence ("" without the run)."""
    if run is None:
        return ""
    parts = "; ".join(f"{s['scenario']}: {s['lost']} lost, {s['mismatched']} mismatched, {s['leaked_blocks']} "
                      f"leaked, recovery {s['recovery_s']} s" for s in run["scenarios"])
    return "\n" + textwrap.fill(f"{title}: {parts}.", 96, break_on_hyphens=False) + "\n"


def block(chaos: dict, busy: dict | None, tls: dict | None = None) -> str:
    def row(cells) -> str:
        return "| " + " | ".join(map(_cell, cells)) + " |\n"
    rows = row(COLUMNS) + row(["---"] * len(COLUMNS)) + "".join(row((
        STACKS.get(s.get("stack", "single"), s.get("stack")), s["scenario"],
        f"{s['lost']} / {s['mismatched']} / {s['leaked_blocks']}", s["recovery_s"], s["extra_s"], s["moved_streams"],
        s["moved_recovery_s"], s["local_recomputes"], s["itl_p99_during_over_before"],
        s["itl_p99_during_over_reference"])) for s in chaos["scenarios"])
    c = chaos["config"]
    text = textwrap.fill(f"The committed run: {c['requests']} requests of {c['max_tokens']} tokens per scenario "
                         "(\"extra load time\" is negative where the run without faults, the stack's first, was the "
                         "slower):", 96, break_on_hyphens=False) + f"\n\n{rows}"
    text += line("Beside a busy neighbour (`make chaos-busy`, `bench/results/chaos-busy.json`)", busy)
    text += line("With NATS and Redis on mutual TLS (`make chaos-tls`, `bench/results/chaos-tls.json`)", tls)
    return f"{BEGIN}\n{text}{END}"


def current() -> str:
    def read(name: str) -> dict | None:
        path = RESULTS / name
        return json.loads(path.read_text()) if path.exists() else None
    chaos = read("chaos.json")
    assert chaos is not None, "no bench/results/chaos.json: run `make chaos`"
    return block(chaos, read("chaos-busy.json"), read("chaos-tls.json"))


def write() -> None:
    text = RESULTS_DOC.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    RESULTS_DOC.write_text(text[:start] + current() + text[end:])


if __name__ == "__main__":
    write()
