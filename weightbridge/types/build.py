"""Frozen value types made by the million: `instances`."""

from __future__ import annotations

import dataclasses
from collections import deque
from itertools import repeat


def instances(cls, n: int, columns) -> list:
    """``n`` instances of the frozen slots dataclass ``cls``, equal to ``cls(*values)`` for the
    values taken from ``columns`` (one iterable per field, in field order).

    Fields are set through their slot descriptors, column by column, in C loops: a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__`` from Python, twice
    the time, which matters at the millions of boxes of a paper-scale plan and the pieces of
    its source maps."""
    fields = dataclasses.fields(cls)
    assert len(columns) == len(fields), (cls, len(columns))
    made = list(map(object.__new__, repeat(cls, n)))
    for field, column in zip(fields, columns):
        deque(map(getattr(cls, field.name).__set__, made, column), maxlen=0)
    return made
