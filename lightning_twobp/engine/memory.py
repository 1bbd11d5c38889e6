"""CPU memory: keep freed blocks in the process instead of returning them to the OS every step.

glibc unmaps a freed block above its mmap threshold and trims the top of the heap when more than the
trim threshold is free; the next allocation of that size then faults in fresh zeroed pages. A pipeline
step allocates and frees the same multi-MB activations micro-batch after micro-batch, so on CPU it pays
those page faults again and again, which a GPU never does (its caching allocator keeps memory).
Measured on the benchmark workload (tiny LLaMa 8 x 512, batch 32 x 128, m = 8, 2 gloo ranks): 20 000
to 40 000 minor page faults per step and rank with glibc's defaults, about 1 000 with these settings,
for our schedules and torch.distributed.pipelining's alike (docs/benchmarks.md, "glibc's allocator").
The price: the process keeps its peak heap (as a GPU's caching allocator keeps its peak reserved).

``TwoBPStrategy`` applies it on CPU; ``TWOBP_KEEP_FREED_MEMORY=0`` turns that off.
"""

from __future__ import annotations

import os

__all__ = ["cpu_heap", "keep_freed_memory", "return_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return False
    libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    return True


def keep_freed_memory() -> bool:
    """Raise glibc's mmap threshold to 32 MiB and its trim threshold to 1 GiB for this process.
    Returns whether it was applied (not on other C libraries, nor with ``TWOBP_KEEP_FREED_MEMORY=0``)."""
    if os.environ.get("TWOBP_KEEP_FREED_MEMORY", "1") == "0":
        return False
    return _mallopt(32 * 1024 * 1024, 1 << 30)


def return_freed_memory() -> bool:
    """The other way: every block above 64 KiB its own mapping, unmapped when freed, so the resident set
    follows the tensors alive (what a GPU allocator's ``max_memory_allocated`` counts) and not the heap's
    high-water mark. Kept freed memory fragments: measured on the benchmark workload, a step's resident
    peak is 15-25% above the tensors' peak with :func:`keep_freed_memory` and about 5% above without
    (docs/benchmarks.md, "Within a memory budget"). Returns whether it was applied (glibc only)."""
    return _mallopt(64 * 1024, 128 * 1024)


def cpu_heap(memory_limit: object) -> str:
    """The strategy's choice on CPU: ``"returned"`` under a ``memory_limit`` (what ``schedule="auto"``
    predicts are tensors; a kept heap's fragments would put the resident set 15-25% above them), else
    ``"kept"`` (the speed: no page faults every step). ``TWOBP_KEEP_FREED_MEMORY=1`` keeps it under a limit
    too, ``0`` never keeps it. Returns what was applied (``"default"``: glibc's own, or not glibc)."""
    env = os.environ.get("TWOBP_KEEP_FREED_MEMORY")
    if memory_limit is not None and env != "1":
        return "returned" if return_freed_memory() else "default"
    return "kept" if keep_freed_memory() else "default"
