"""The clock every lease computation uses."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["clock"]


def _boottime() -> float:
    # CLOCK_BOOTTIME keeps counting while the machine is suspended, as the
    # Redis TTL does; CLOCK_MONOTONIC would not.
    return time.clock_gettime(time.CLOCK_BOOTTIME)


#: Seconds on a clock that never jumps with wall-clock changes.
clock: Callable[[], float] = _boottime if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic
