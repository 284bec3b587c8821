"""`check_version`: what every path accepts as a version (a positive int), checked once."""

from __future__ import annotations

import numbers


def check_version(version, call: str = "send_weights") -> int:
    """``version`` as an int, or ValueError: versions are positive ints (a bool or a float is
    refused, not rounded: ``True`` would be version 1 and ``1.5`` no version at all)."""
    if (isinstance(version, bool) or not isinstance(version, numbers.Integral)
            or version < 1):
        raise ValueError(f"{call}: version must be a positive int (1, 2, ...: the number of "
                         f"the update, increasing from one send_weights to the next), got "
                         f"{version!r}")
    return int(version)
