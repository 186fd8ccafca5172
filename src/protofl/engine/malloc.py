"""Keep glibc from handing freed memory back to the OS after every training step.

Training allocates and frees the same activation-sized buffers every step; with glibc's
default thresholds large ones go through mmap/munmap (or trim the heap) each time and
every step pays page faults. Raising the trim and mmap thresholds -- what the env vars
``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_`` do at process start -- keeps
them in the heap. Called by the simulator and every worker; a no-op off glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
_done = False


def tune_malloc(trim: int = 1 << 27, mmap: int = 1 << 25) -> bool:
    """Raise glibc's trim threshold (128 MiB) and mmap threshold (32 MiB, glibc's maximum).

    Buffers up to 32 MiB are reused from the heap instead of being mapped and unmapped
    every step; the heap is trimmed only when more than 128 MiB are free at its top, so
    peak memory stays bounded.

    Returns True when applied. Respects explicit ``MALLOC_*_`` environment settings.
    """
    global _done
    if _done:
        return True
    if os.environ.get("MALLOC_TRIM_THRESHOLD_") or os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        _done = True
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok: bool = mallopt(M_TRIM_THRESHOLD, ctypes.c_int(trim)) == 1
    ok = mallopt(M_MMAP_THRESHOLD, ctypes.c_int(mmap)) == 1 and ok
    _done = ok
    return ok
