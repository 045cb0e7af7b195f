"""The CPU a benchmark ran on, written beside its figures (machines differ: AMD EPYC, Intel Xeon)."""

from __future__ import annotations

from pathlib import Path


def cpu_model() -> str:
    """/proc/cpuinfo's model name ("" where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
