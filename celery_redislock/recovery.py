"""Worker start: release the locks a previous run of this worker node left behind.

When a whole worker is killed (SIGKILL, OOM, a lost VM), nobody releases its
locks: renewal stops, and each key expires one TTL later. But every running
holder's value names its worker node and the pid that ran the body (see
``tokens.py``), so the next start of that node (systemd, supervisor, a pod
with a stable hostname) can tell its previous run's locks apart and release
them at once. A lock is released only when all of these hold:

* its value is a running holder's (not *queued*, *kept* or *parked*) and
  names exactly this worker's node name: never another host, never another
  worker on this host;
* it was taken before this worker process started, so no worker running
  now under the same name (a misconfiguration) took it while we start;
* no process with its pid runs on this host, or the one that does started
  after the lock was taken (the pid was reused). A process whose start time
  cannot be read (no ``/proc``) counts as the holder.

The keys are found and released through :class:`~celery_redislock.admin.LockInventory`
(``SCAN`` and an exact compare-and-delete, which hands the key over to a
parked call as any release does). Each slot of a ``lock_limit`` key is its
own key and value, so each is decided and released on its own.

This relies on node names being unique and stable across restarts, which
Celery already asks for (``-n name@%h``).
"""

from __future__ import annotations

import enum
import logging
import math
import os
import time
from collections.abc import Callable

from celery import Celery

from celery_redislock.admin import LockInventory, LockRecord
from celery_redislock.exceptions import LockBackendError
from celery_redislock.store import ReleaseOutcome
from celery_redislock.tokens import KEPT_HOST, PARKED_HOST, QUEUED_HOST, LockValue

__all__ = [
    "START_SLACK_MS",
    "UNKNOWN_START",
    "Decision",
    "decide",
    "process_started_ms",
    "recover_at_start",
    "recover_locks",
    "this_process_started_ms",
]

logger = logging.getLogger("celery_redislock.recovery")

#: Where the process table is read (``/proc/<pid>/stat``).
PROC = "/proc"

#: What :func:`process_started_ms` returns for a process that runs but whose
#: start time cannot be read: the earliest time there is, so it counts as
#: started before any lock, i.e. as the lock's holder.
UNKNOWN_START = 0

#: A process must have started this long after a lock was taken to count as
#: a reused pid rather than the holder: slack for the clock ticks of the start
#: time and for a small wall-clock step between the lock's acquisition and now.
START_SLACK_MS = 1000

#: The hostname fields of values that no running process holds.
_NOT_RUNNING_HOSTS = frozenset({QUEUED_HOST, KEPT_HOST, PARKED_HOST})


class Decision(enum.Enum):
    """What start-up recovery does with one lock value, and why."""

    #: Left by a previous run of this node: released.
    RELEASE = "release"
    #: Not a value this package writes.
    UNKNOWN_VALUE = "unknown value"
    #: Queued, kept after success or parked: nobody runs it.
    NOT_RUNNING = "not a running holder"
    #: Another worker node (another host, or another worker on this host).
    OTHER_NODE = "another node"
    #: The value names no process.
    NO_PROCESS = "no pid"
    #: Taken after this worker process started.
    TAKEN_SINCE_START = "taken since this worker started"
    #: Its pid runs, and that process was already running when it was taken.
    HOLDER_RUNS = "its holder runs"


def decide(
    value: LockValue | None,
    node: str,
    worker_started_ms: int,
    started_ms: Callable[[int], int | None],
) -> Decision:
    """Decide whether start-up recovery releases one lock value.

    Args:
        value: The decoded value (``None`` when it is not in format v1).
        node: This worker's node name (``worker.hostname``).
        worker_started_ms: When this worker process started (Unix ms).
        started_ms: ``started_ms(pid)``: when the process with that pid on
            this host started (Unix ms), :data:`UNKNOWN_START` if it runs
            but its start is unknown, ``None`` if none runs. Asked only for
            values this node's previous run may have left.

    Returns:
        :attr:`Decision.RELEASE`, or the reason the value is kept.
    """
    if value is None:
        return Decision.UNKNOWN_VALUE
    owner = value.owner
    if owner.hostname in _NOT_RUNNING_HOSTS:
        return Decision.NOT_RUNNING
    if owner.hostname != node:
        return Decision.OTHER_NODE
    if owner.pid is None or owner.pid <= 0:
        return Decision.NO_PROCESS
    if value.acquired_ms >= worker_started_ms:
        return Decision.TAKEN_SINCE_START
    started = started_ms(owner.pid)
    if started is not None and started <= value.acquired_ms + START_SLACK_MS:
        return Decision.HOLDER_RUNS
    return Decision.RELEASE


def process_started_ms(pid: int) -> int | None:
    """When the process ``pid`` on this host started (Unix ms), read from ``/proc``.

    Returns:
        ``None`` when no such process runs (a zombie has ended: it runs no
        code); :data:`UNKNOWN_START` when it runs but its start time cannot
        be read (no ``/proc``, or it is hidden from us).
    """
    if pid <= 0:
        return None
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as stat:
            # The command name (field 2) may hold spaces and parentheses.
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        fields = None
    if fields:
        if fields[0] in (b"Z", b"X"):  # field 3, the state: zombie or dead
            return None
        try:
            # Field 22: start time in clock ticks after the boot.
            ticks = int(fields[19])
            boot_ms = _boot_time_ms()
        except (IndexError, ValueError, OSError):
            return UNKNOWN_START
        # Rounded down: an earlier start only ever keeps a lock.
        return math.floor(boot_ms + ticks * 1000 / os.sysconf("SC_CLK_TCK"))
    # No entry: the process is gone, there is no /proc, or hidepid hides it.
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # it runs, as another user
        return UNKNOWN_START
    return UNKNOWN_START


def _boot_time_ms() -> float:
    """When this host booted (Unix ms), on the clock ``/proc/<pid>/stat`` counts from.

    Start times count from the boot including suspend (``CLOCK_BOOTTIME``);
    ``/proc/stat``'s ``btime`` is the same instant in whole seconds.
    """
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is not None:
        # Wall clock first: the time between the two readings can only make
        # the boot, and so every start time, look earlier (keeping locks).
        return time.time() * 1000 - time.clock_gettime(boottime) * 1000
    with open(f"{PROC}/stat", "rb") as stat:
        for line in stat:
            if line.startswith(b"btime "):
                return int(line.split()[1]) * 1000.0
    raise OSError("no btime in /proc/stat")


def this_process_started_ms(fallback_ms: int) -> int:
    """When this process started (Unix ms), or ``fallback_ms`` when that cannot be read."""
    started = process_started_ms(os.getpid())
    return fallback_ms if started in (None, UNKNOWN_START) else int(started)


def recover_locks(app: Celery, node: str, worker_started_ms: int) -> list[LockRecord]:
    """Release the app's locks that a previous run of worker ``node`` left behind.

    Logs one WARNING per released key. See the module docstring for the rule.

    Args:
        app: The app whose lock keys (``redislock_key_prefix``) are scanned.
        node: This worker's node name.
        worker_started_ms: When this worker process started (Unix ms).

    Returns:
        The records of the locks it released, in the order released.

    Raises:
        LockBackendError: the lock store is unreachable.
        ConfigurationError: the app's lock settings are unusable.
    """
    inventory = LockInventory(app)
    released: list[LockRecord] = []
    for record in inventory.locks():
        value = LockValue.decode(record.value)
        if decide(value, node, worker_started_ms, process_started_ms) is not Decision.RELEASE:
            continue
        if inventory.release(record, log=False) is not ReleaseOutcome.RELEASED:
            continue  # it changed hands (or expired) since it was read
        released.append(record)
        logger.warning(
            "celery-redislock: released lock %s (task %s, task id %s) left by pid %s "
            "of a previous run of %s",
            record.key,
            record.task_name,
            record.task_id,
            record.pid,
            node,
        )
    return released


def recover_at_start(app: Celery, node: str, worker_started_ms: int) -> int | None:
    """Release what a previous run of worker ``node`` left behind; log one summary line.

    Never raises: a store that stops answering, or anything unexpected, is
    logged at WARNING and the worker keeps starting.

    Returns:
        How many locks were released; None when recovery failed.
    """
    began = time.monotonic()
    try:
        released = recover_locks(app, node, worker_started_ms)
    except LockBackendError as exc:
        logger.warning(
            "celery-redislock: locks left by a previous run of %s were not recovered (%s); "
            "they expire with their TTL.",
            node,
            exc,
        )
        return None
    except Exception:
        # A bug here must not keep the worker from starting; say so loudly.
        logger.warning(
            "celery-redislock: recovering the locks left by a previous run of %s failed; "
            "they expire with their TTL.",
            node,
            exc_info=True,
        )
        return None
    took = time.monotonic() - began
    if released:
        logger.info(
            "celery-redislock: recovered %d lock%s left by a previous run of %s (%.3f s).",
            len(released),
            "" if len(released) == 1 else "s",
            node,
            took,
        )
    else:
        logger.info(
            "celery-redislock: found no locks left by a previous run of %s (%.3f s).", node, took
        )
    return len(released)
