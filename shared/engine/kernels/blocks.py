"""The C kernel for products with a GGUF file's own Q4_1 / Q8_0 blocks (blocks.c), built on
first use with the machine's C compiler (`$CC`, else `cc`; `-O3 -march=native -fopenmp`) and
kept in `$XDG_CACHE_HOME/pdserve` (else ~/.cache/pdserve) under a name that hashes the source,
the flags and this CPU's feature flags, so a cache shared by other machines is never wrong.
Several workers building at once each write their own file and rename it into place.

It is called through ctypes, which releases the GIL; its threads are OpenMP's, from the
runtime torch has already loaded (same `libgomp.so.1`), so they are torch's intra-op threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("blocks.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
PORTABLE = ("-O3", "-fopenmp", "-shared", "-fPIC")  # no AVX2: the kernel's plain-C path
KINDS = {"Q4_1": 0, "Q8_0": 1}


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


def build(flags: tuple[str, ...] = FLAGS) -> Path:
    """The kernel built with `flags` (built now if this machine has not built this source with
    them yet)."""
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((cc, *flags, platform.machine(), _cpu_flags())).encode())
    target = _cache_dir() / f"blocks-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"PD_WEIGHTS=native needs a C compiler to build its kernel ({cc} "
                               f"{' '.join(flags)} {SOURCE} failed):\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    except FileNotFoundError as e:
        raise RuntimeError(f"PD_WEIGHTS=native needs a C compiler to build its kernel: {cc} not found "
                           "(install one, set $CC, or run PD_WEIGHTS=fp32)") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.blocks_matmul.restype = ctypes.c_int
    lib.blocks_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                                  ctypes.c_int, ctypes.c_int]
    return lib


@cache
def library() -> ctypes.CDLL:
    """The kernel for this machine's CPU."""
    return bind(build())


def _ptr(t: torch.Tensor | None, shape: tuple[int, ...]) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape:
        raise ValueError(f"expected a contiguous float32 tensor {shape}, got {t.dtype} {tuple(t.shape)}")
    return t.data_ptr()


def matmul(kind: str, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
           norm: tuple[torch.Tensor, float] | None = None, swiglu: bool = False,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """residual + f(x) @ W.T for W (N, K) as the file's blocks: w (N, K/32 · bytes a block)
    uint8, contiguous; f RMS-normalizes with `norm` (weight (K,), eps), or with `swiglu` takes
    x (M, 2K) as (gate, up) and computes silu(gate)·up. Returns (M, N) fp32. `lib`: another
    build of the kernel (tests)."""
    x = x.to(torch.float32).contiguous()
    m, k = x.shape[0], x.shape[1] // 2 if swiglu else x.shape[1]
    n = w.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    weight, eps = norm if norm is not None else (None, 0.0)
    rc = (lib or library()).blocks_matmul(KINDS[kind], x.data_ptr(), m, k, w.data_ptr(), n, y.data_ptr(),
                                 _ptr(residual, (m, n)), _ptr(weight, (k,)), eps, int(swiglu),
                                 torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"blocks_matmul failed for x {tuple(x.shape)} (input width not a multiple of 32, "
                           "or out of memory)")
    return y
