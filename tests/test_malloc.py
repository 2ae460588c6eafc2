"""Importing magicdec keeps freed memory for the next step's large tensors (glibc's mallopt), unless switched off."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# A 100 MB tensor freed and allocated again: how many page faults the second allocation took.
SNIPPET = """
import resource, magicdec, torch
x = torch.ones(25 << 20); del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
y = torch.ones(25 << 20)
print(magicdec.MALLOC, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_of_a_reallocation(**env: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", SNIPPET], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults():
    """Kept: the second 100 MB allocation reuses the first's pages (measured: 1 fault); switched off, it is mapped and
    faulted in afresh (measured: 562 with huge pages, 25601 without)."""
    mode, faults = faults_of_a_reallocation()
    assert mode == "kept" and faults < 50
    mode, faults = faults_of_a_reallocation(MAGICDEC_MALLOPT="0", THP_MEM_ALLOC_ENABLE="0")
    assert mode == "default" and faults > 10_000
