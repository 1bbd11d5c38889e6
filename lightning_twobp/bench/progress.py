"""One line on stderr at each stage of a long benchmark: a run of minutes says where it is (the tables come
at its end)."""

from __future__ import annotations

import sys
import time

__all__ = ["say"]


def say(what: str) -> None:
    print(f"[twobp-bench {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)
