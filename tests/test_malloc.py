"""Importing magicdec keeps freed memory for the next step's large tensors (glibc's mallopt), unless switched off.

What is checked is the allocator's state, which the settings decide: a freed 100 MB tensor stays in malloc's heap
(kept), or its mapping goes back to the system (default). What that saves, page faults and time, depends on the
machine and on what else runs; `magicdec/__init__.py` quotes the measurements.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# A 100 MB tensor allocated and freed: where its memory went (mallinfo2, glibc >= 2.33: bytes free in the heap, and
# bytes still mapped for large blocks).
SNIPPET = """
import ctypes, magicdec, torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
x = torch.ones(25 << 20)
mapped = mallinfo2().hblkhd
del x
after = mallinfo2()
print(magicdec.MALLOC, mapped, after.fordblks, after.hblkhd)
"""
MB = 1 << 20


def freed_100mb(**env: str) -> tuple[str, int, int, int]:
    """(magicdec.MALLOC, bytes mapped for large blocks while the tensor lives, bytes free in the heap after it is
    freed, bytes mapped after)."""
    out = subprocess.run([sys.executable, "-c", SNIPPET], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return out[0], int(out[1]), int(out[2]), int(out[3])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_freed_memory_stays_in_the_heap_unless_switched_off():
    """Kept: the 100 MB block comes from the heap and stays there when freed, for the next step's tensors to reuse;
    switched off, it has a mapping of its own, unmapped when freed (faulted in afresh at the next allocation)."""
    mode, mapped, free, mapped_after = freed_100mb()
    assert mode == "kept" and mapped < 100 * MB and free >= 100 * MB
    mode, mapped, free, mapped_after = freed_100mb(MAGICDEC_MALLOPT="0")
    assert mode == "default" and mapped >= 100 * MB and free < 100 * MB and mapped_after < 100 * MB
