"""pdserve/shared/flow.py is the map of a request's path: every file it names exists."""

import re
from pathlib import Path

import pdserve.shared.flow

ROOT = Path(__file__).resolve().parents[2]


def test_every_file_the_request_map_names_exists():
    path = r"\b(?:pdserve/(?:services|shared|local|planner)|bench)/[\w/]+\.py\b"
    named = set(re.findall(path, pdserve.shared.flow.__doc__ or ""))
    assert len(named) >= 10  # the map names files (the pattern still matches how it writes them)
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"pdserve/shared/flow.py names files that do not exist: {missing}"
