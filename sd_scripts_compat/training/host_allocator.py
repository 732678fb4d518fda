"""The C allocator keeps what a training step frees for the next step (Linux with glibc, training on the CPU).

On a CPU a step's activations are host memory. glibc gives memory freed at the top of its heap back to the
kernel and serves large blocks with fresh mappings, so every step faults in and zeroes its activations again:
measured on the SD1.5 UNet at 256 px on a 2-core CPU, 490-580 thousand page faults a step and a quarter to a
third of the step's time. A fixed mmap threshold and no trimming (``mallopt``) keep that memory in the heap for
reuse, as a GPU's caching allocator keeps device memory; the step's result is the same. Hand-written: torch has
no caching allocator for ordinary host tensors and no maintained library wraps ``mallopt``.
"""

from __future__ import annotations

import platform
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling on 64-bit systems: larger blocks are always mapped afresh
# -1: never trim (glibc's documented value). A finite one fails where it matters: mallopt takes an int, and a
# step's activations (1.8 GiB for SD1.5 at 256 px) freed at the heap's top crossed its 2 GiB ceiling in one run of
# five, which then faulted 470 thousand pages a step
TRIM_NEVER = -1


def keep_freed_host_memory() -> bool:
    """Fix glibc's thresholds for this process; False (nothing changed) on other systems and C libraries."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    import ctypes

    mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_NEVER) == 1
