"""This process's pid, read without a system call.

Every fork-safety check of the package (a forked child never uses its
parent's connections, renewer or locks) compares a pid with the current
one. ``os.getpid()`` is a system call (glibc stopped caching it), and a lock
cycle made nine of them: measured with ``strace -c`` over 1,200 cycles,
11,040 ``getpid`` calls, more than every socket call together. The pid is
read once and again in every child forked by ``os.fork()`` (which is how
billiard, Celery's prefork pool and multiprocessing's fork start method make
children: ``os.register_at_fork`` runs there).
"""

from __future__ import annotations

import os

__all__ = ["current_pid"]

_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def current_pid() -> int:
    """The pid of this process (as ``os.getpid()``, without its system call)."""
    return _pid
