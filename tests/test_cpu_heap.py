"""On CPU the strategy keeps glibc's freed memory for speed, except under a ``memory_limit``: there the
resident set should follow the tensors ``schedule="auto"`` predicts (engine.memory.cpu_heap)."""

from __future__ import annotations

import platform

import pytest

from lightning_twobp.engine import memory


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []

    def record(mmap_threshold: int, trim_threshold: int) -> bool:
        seen.append((mmap_threshold, trim_threshold))
        return True

    monkeypatch.setattr(memory, "_mallopt", record)
    monkeypatch.delenv("TWOBP_KEEP_FREED_MEMORY", raising=False)
    return seen


def test_the_heap_is_kept_without_a_limit_and_returned_under_one(calls: list[tuple[int, int]]) -> None:
    assert memory.cpu_heap(None) == "kept"
    assert memory.cpu_heap(8e9) == "returned"
    assert memory.cpu_heap("1f1b") == "returned"
    kept, returned = calls[0], calls[1]
    assert kept == (32 * 1024 * 1024, 1 << 30)  # blocks under 32 MiB stay in the heap, which is never trimmed
    assert returned == (64 * 1024, 128 * 1024)  # every block above 64 KiB unmapped when freed
    assert calls[2] == returned


def test_the_environment_overrides(calls: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWOBP_KEEP_FREED_MEMORY", "1")
    assert memory.cpu_heap(8e9) == "kept"
    monkeypatch.setenv("TWOBP_KEEP_FREED_MEMORY", "0")
    assert memory.cpu_heap(None) == "default"
    assert memory.cpu_heap(8e9) == "returned"
    assert len(calls) == 2


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_both_settings() -> None:
    try:
        assert memory.return_freed_memory() is True
    finally:
        assert memory.keep_freed_memory() is True  # as the rest of the test session runs
