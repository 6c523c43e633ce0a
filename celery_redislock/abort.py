"""Stopping a running execution whose lock was lost (``lock_on_lost="abort"``).

The renewer thread detects the loss; the execution runs in another thread.
How it is stopped depends on where it runs:

* the process's main thread (prefork pool children, the solo pool): a
  signal is sent to that thread, whose handler raises :class:`LockLost`; a
  signal also interrupts a blocking ``time.sleep`` or socket read;
* another native thread (the threads pool): ``PyThreadState_SetAsyncExc``
  raises :class:`LockLost` at the thread's next Python instruction. It is not
  delivered while the thread is blocked inside one C call;
* gevent or eventlet greenlets: not supported; the loss is reported only.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

from celery_redislock.exceptions import LockLost

__all__ = ["ABORT_SIGNAL", "Abortable", "interrupter_for_current_thread", "withdraw_abort"]

logger = logging.getLogger("celery_redislock.abort")

#: A real-time signal nothing in Celery or billiard uses (SIGUSR1 is the soft
#: time limit, SIGUSR2 the debugger hook).
ABORT_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2


class Abortable(Protocol):
    """What an abort needs of a held lock (a :class:`~celery_redislock.lease.LockHandle`)."""

    key: str
    lost_reason: str | None
    #: True once the execution holding it has ended: no abort may reach it.
    finished: bool
    #: Held while an abort is sent and while the execution finishes.
    abort_guard: Any
    #: Thread an asynchronous exception was sent to and not yet delivered.
    abort_sent_to: int | None


_pending: dict[int, Abortable] = {}
_installed = False


def _raise_if_lost(signum: int, frame: FrameType | None) -> None:
    handle = _pending.pop(threading.get_ident(), None)
    if handle is not None and not handle.finished:
        raise LockLost(handle.key, f"{handle.lost_reason}; execution aborted")


def _green() -> bool:
    try:
        from gevent import monkey  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        return False
    return bool(monkey.is_module_patched("threading"))


def interrupter_for_current_thread() -> Callable[[Abortable], None] | None:
    """Return a callback that aborts the calling thread, or None where impossible.

    The callback runs in the renewer thread. It sends the abort under the
    handle's ``abort_guard`` and only while the execution has not finished
    (``LockHandle.finish`` takes the same guard), so an abort can never
    reach code after the execution that asked for it.
    """
    global _installed
    if _green():
        logger.warning("lock_on_lost='abort' is not supported under gevent; reporting only")
        return None
    ident = threading.get_ident()
    if threading.current_thread() is threading.main_thread():
        if not _installed:
            signal.signal(ABORT_SIGNAL, _raise_if_lost)
            _installed = True

        def by_signal(handle: Abortable) -> None:
            with handle.abort_guard:
                if not handle.finished:
                    _pending[ident] = handle
                    signal.pthread_kill(ident, ABORT_SIGNAL)

        return by_signal

    def by_async_exception(handle: Abortable) -> None:
        with handle.abort_guard:
            if not handle.finished:
                handle.abort_sent_to = ident
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(ident), ctypes.py_object(LockLost)
                )

    return by_async_exception


def withdraw_abort(handle: Abortable) -> None:
    """Withdraw an abort sent to the calling thread and not yet delivered.

    Called by ``LockHandle.finish`` under the handle's ``abort_guard``.
    """
    ident = threading.get_ident()
    if _pending.get(ident) is handle:
        _pending.pop(ident, None)
    if handle.abort_sent_to == ident:
        handle.abort_sent_to = None
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
