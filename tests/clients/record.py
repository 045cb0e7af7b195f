"""What each client test ran and how it ended, as rows of bench/results/clients.json (the README's
"Works with" table is generated from that file by bench/clients_readme.py)."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest


@dataclass
class Row:
    client: str
    ran: str
    version: str = ""
    result: str = "not run"
    numbers: dict = field(default_factory=dict)
    seconds: float = 0.0


def row_of(item: pytest.Item) -> Row:
    mark = item.get_closest_marker("works_with")
    return Row(*mark.args)


def outcome(report: pytest.TestReport) -> str:
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return "skipped: " + reason.removeprefix("Skipped: ")
    return "pass" if report.passed else "fail"


def summary(rows: list[Row]) -> str:
    passed = sum(r.result == "pass" for r in rows)
    failed = [f"{r.client} {r.ran}" for r in rows if r.result == "fail"]
    skipped = sum(r.result.startswith("skipped") for r in rows)
    clients = len({r.client for r in rows})
    text = f"{passed} of {len(rows)} client checks pass across {clients} clients"
    if skipped:
        text += f", {skipped} skipped"
    return text + (f"; failed: {', '.join(failed)}" if failed else "")


def write(path: Path, rows: list[Row], model: str, install_s: dict[str, float]) -> None:
    doc = {
        "summary": summary(rows),
        "config": {"model": model, "stack": "1 prefill + 1 decode worker (pdserve.local.stack)",
                   "machine": f"{platform.machine()}, CPU", "date": time.strftime("%Y-%m-%d")},
        "install_s": install_s,
        "clients": [asdict(r) for r in rows],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
