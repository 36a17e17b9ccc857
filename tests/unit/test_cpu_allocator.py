"""training.cpu_allocator: in heap mode glibc serves large CPU tensors from the heap, not mmap."""

import subprocess
import sys

import pytest

from hybridtrain.training.cpu_allocator import configure_cpu_allocator

_MMAPPED = r"""
import ctypes, sys, torch
from hybridtrain.training.cpu_allocator import configure_cpu_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                              "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
print(configure_cpu_allocator(sys.argv[1], "cpu"))
x = torch.empty(16 << 20)  # 64 MiB, above any mmap threshold of glibc's
print(libc.mallinfo2().hblkhd)  # bytes held in mmapped blocks
"""


def _mmapped_bytes(mode):
    out = subprocess.run([sys.executable, "-c", _MMAPPED, mode], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"no glibc mallinfo2 here: {out.stderr.strip().splitlines()[-1:]}")
    effect, mmapped = out.stdout.split()
    return effect, int(mmapped)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_heap_mode_serves_large_tensors_from_the_heap():
    effect, heap = _mmapped_bytes("heap")
    if effect != "heap":
        pytest.skip(f"C library without mallopt ({effect})")
    _, system = _mmapped_bytes("system")
    assert system >= 64 << 20, system  # glibc default: the 64 MiB tensor is its own mmap
    assert heap < 64 << 20, heap


def test_modes_and_errors():
    assert configure_cpu_allocator("system", "cpu") == "system"
    assert configure_cpu_allocator("auto", "meta") == "system"  # not CPU training: untouched
    with pytest.raises(ValueError, match="training.cpu_allocator"):
        configure_cpu_allocator("jemalloc", "cpu")
