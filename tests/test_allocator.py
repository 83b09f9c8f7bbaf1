"""The host allocator settings (ratrain.shim.allocator)."""

import ctypes.util
import subprocess
import sys

import pytest

from ratrain.shim import allocator

GLIBC = sys.platform.startswith("linux") and bool(ctypes.util.find_library("c"))

PROBE = """
import resource, sys
import numpy as np
from ratrain.shim import allocator
ok = allocator.tune(sys.argv[1])
try:  # 4 KiB pages, so that every page touched anew counts
    np._core.multiarray._set_madvise_hugepage(False)
except AttributeError:
    pass
N = 48 << 20  # 48 MiB: above glibc's largest dynamic mmap threshold (32 MiB)
a = np.ones(N, np.uint8)
del a
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    a = np.ones(N, np.uint8)  # touched again: faults unless the memory was kept
    del a
print(ok, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def probe(mode):
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_tuned_allocator_keeps_freed_memory():
    ok, faults = probe("tuned")
    assert ok
    # 10 x 48 MiB = 122,880 pages would fault if each array were a fresh mmap
    assert faults < 5000, faults


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_default_allocator_left_alone_on_request():  # run.malloc: default
    ok, faults = probe("default")
    assert not ok
    assert faults > 100_000, faults  # what the settings avoid: every array faults anew


def test_tune_is_idempotent():
    first = allocator.tune()
    assert allocator.tune() is first
    assert allocator.tuned() is first
