"""shared/flow.py is the map of a request's path: every file it names exists."""

import re
from pathlib import Path

import shared.flow

ROOT = Path(__file__).resolve().parents[2]


def test_every_file_the_request_map_names_exists():
    named = set(re.findall(r"\b(?:services|shared|deploy|bench)/[\w/]+\.py\b", shared.flow.__doc__ or ""))
    assert len(named) >= 10  # the map names files (the pattern still matches how it writes them)
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"shared/flow.py names files that do not exist: {missing}"
