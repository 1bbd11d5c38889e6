"""Results a search may reuse, kept only while it runs.

``schedule="auto"``'s search builds every family at every micro-batch count and cap, and the same pure
steps repeat across those builds: ZB-H2 weighs ZB-H1's order at the same request, a cap at or above what
an order ever has waiting builds that order again, and the greedy's policies and tie-breaks mostly come to
orders already scored (two in three of a p = 8 search's scores). Inside :func:`remembered` each
:func:`kept` function returns what it returned before for the same arguments; outside it, it runs as
written. So nothing is held after the search (a p = 8 search keeps about 35 MiB of orders while it runs),
a test or user that patches a builder between searches sees its patch, and a single build is never
slower than before. The functions kept must be pure functions of hashable arguments.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

__all__ = ["kept", "remembered", "remembering"]

_TABLE: ContextVar[dict[tuple, Any] | None] = ContextVar("twobp_schedules_memo", default=None)
F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def remembered() -> Iterator[None]:
    """Within: every :func:`kept` function's results are kept and reused (nested: the outer table)."""
    if _TABLE.get() is not None:
        yield
        return
    token = _TABLE.set({})
    try:
        yield
    finally:
        _TABLE.reset(token)


def remembering() -> bool:
    """Whether results are being kept (inside :func:`remembered`)."""
    return _TABLE.get() is not None


def kept(fn: F) -> F:
    """``fn`` with its results reused inside :func:`remembered`, by its positional arguments."""

    @functools.wraps(fn)
    def reuse(*args: Any) -> Any:
        table = _TABLE.get()
        if table is None:
            return fn(*args)
        key = (fn, args)
        if key not in table:
            table[key] = fn(*args)
        return table[key]

    return reuse  # type: ignore[return-value]
