"""The name this machine's profile goes by (bench/results/profile-<device>.json): `cpu`, or the
CUDA device's name."""

from __future__ import annotations


def device_name() -> str:
    import torch
    if torch.cuda.is_available():
        return "cuda-" + torch.cuda.get_device_name().lower().replace(" ", "-")
    return "cpu"
