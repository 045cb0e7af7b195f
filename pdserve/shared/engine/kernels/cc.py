"""The engine's C kernels (blocks.c, attention.c, fused.c), built on first use with the machine's C
compiler (`$CC`, else `cc`; `-O3 -march=native -fopenmp`) and kept in `$XDG_CACHE_HOME/pdserve`
(else ~/.cache/pdserve) under a name that hashes the source (and what it includes), the flags and this CPU's feature
flags, so a cache shared by other machines is never wrong. Several workers building at once each
write their own file and rename it into place.

They are called through ctypes, which releases the GIL; their threads are OpenMP's, from the
runtime torch has already loaded (the same `libgomp.so.1`), so they are torch's intra-op threads.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
PORTABLE = ("-O3", "-fopenmp", "-shared", "-fPIC")  # no AVX2: a kernel's plain-C path


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve"


def build(source: Path, flags: tuple[str, ...] = FLAGS, includes: tuple[Path, ...] = ()) -> Path:
    """`source` built with `flags` as a shared library (now, if this machine has not built it);
    `includes`: the files it #includes, hashed with it."""
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(b"".join(f.read_bytes() for f in (source, *includes))
                         + " ".join((compiler, *flags, platform.machine(), _cpu_flags())).encode())
    target = _cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {source.name} failed ({compiler} {' '.join(flags)}):\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    except FileNotFoundError as e:
        raise RuntimeError(f"the engine's CPU kernels need a C compiler: {compiler} not found "
                           "(install one or set $CC)") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def has_feature(flag: str) -> bool:
    """Whether this CPU lists `flag` (/proc/cpuinfo's spelling: avx2, avx512_vnni, …)."""
    return flag in _cpu_flags().split()
