"""Python's cyclic garbage collector paused while the controller builds or reads millions of
small objects.

Connect unpickles every worker's source map, plans, builds every worker's plan and pickles
each: at the paper's largest deployment millions of small acyclic objects (pieces, copies,
writes), which the collector rescans again and again as they pile up, freeing nothing. Paused,
unpickling Kimi-K2's 512 maps took 1.9 s instead of 5.8 s and planning it 4.5 s instead of
6.0-6.6 s (docs/notes/probe-speed.md, "Sixth round"). Reference counting still frees what is
dropped meanwhile; cycles wait for the next collection after the pause.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from typing import Callable, Iterator, TypeVar

_lock = threading.Lock()
_paused = 0
"""Pauses in progress (threads may overlap them)."""
_was_enabled = True
"""Whether the collector ran before the first of them."""

F = TypeVar("F", bound=Callable)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic cyclic collection inside; the collector's state before the outermost pause
    comes back after it (a caller that had disabled it keeps it disabled)."""
    global _paused, _was_enabled
    with _lock:
        if _paused == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _lock:
            _paused -= 1
            if _paused == 0 and _was_enabled:
                gc.enable()


def with_gc_paused(fn: F) -> F:
    """``fn`` run inside `gc_paused`."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        with gc_paused():
            return fn(*args, **kwargs)
    return paused  # type: ignore[return-value]
