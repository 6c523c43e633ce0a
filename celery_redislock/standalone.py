"""What the standalone locks share: arguments, reentrant holds, contention, a grant's bookkeeping.

``RedisLock`` and ``AsyncRedisLock`` are both a :class:`StandaloneLock`.
What an acquire's outcome means (granted, contended, unanswered,
interrupted) is decided here once; their modules are the drivers: each
does the I/O between those steps in its own try block and gives a value
back its own way (the tests interrupt every line of both).
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from celery_redislock import signals
from celery_redislock._clock import clock
from celery_redislock.exceptions import ConfigurationError, LockBackendError, LockNotOwned
from celery_redislock.leasing import Lease
from celery_redislock.outcomes import AcquireResult
from celery_redislock.owners import Hold, Holds
from celery_redislock.tokens import LockOwner, LockValue
from celery_redislock.validators import validate_flag, validate_ttl, validate_wait_timeout

__all__ = ["StandaloneLock", "blocking_waits"]

H = TypeVar("H", bound=Lease)
S = TypeVar("S")
C = TypeVar("C")
L = TypeVar("L")

# Values this process's standalone locks sent in acquires that timed out,
# per lock store and name: their scripts may have run after all. Bounded;
# weak per store, so a dropped client takes its entries along.
# (The async store keeps its values here too: the same rule, another store type.)
_UNSETTLED: weakref.WeakKeyDictionary[Any, dict[str, collections.deque[str]]] = (
    weakref.WeakKeyDictionary()
)
_MAX_UNSETTLED = 8

#: No contention seen yet (immutable, so one instance serves every lock).
_NO_CONTENTION = AcquireResult(False)


def _unsettled(backend: Any, name: str) -> tuple[str, ...]:
    """Values of ``name``'s acquires that timed out in this process (to take over)."""
    per_name = _UNSETTLED.get(backend)
    return tuple(per_name.get(name, ())) if per_name is not None else ()


def _note_unsettled(backend: Any, name: str, value: str) -> None:
    per_name = _UNSETTLED.get(backend)
    if per_name is None:
        per_name = _UNSETTLED.setdefault(backend, {})
    values = per_name.get(name)
    if values is None:
        values = per_name.setdefault(name, collections.deque(maxlen=_MAX_UNSETTLED))
    values.append(value)


def _settle(backend: Any, name: str, adopted: tuple[str, ...]) -> None:
    """Forget the ``adopted`` values: an acquire took them over (or found them gone)."""
    per_name = _UNSETTLED.get(backend)
    values = None if per_name is None else per_name.get(name)
    if per_name is None or values is None:
        return
    for value in adopted:  # not clear(): another thread may have added one since
        with contextlib.suppress(ValueError):
            values.remove(value)
    if not values:
        per_name.pop(name, None)


def blocking_waits(result: AcquireResult, blocking: bool, timeout: float | None) -> Iterator[float]:
    """The waits for a release after a first acquire found ``result``, each up to so long.

    None (not blocking, acquired, no time left); ``timeout`` once; or, with
    no timeout, 60 s slices until acquired.
    """
    if not blocking or result.acquired or (timeout is not None and timeout <= 0):
        return
    if timeout is not None:
        yield timeout
        return
    while True:  # wait as long as it takes, in bounded slices
        yield 60.0


class StandaloneLock(Generic[H, S, C]):
    """A standalone lock's state and bookkeeping (``H``: handle, ``S``: store, ``C``: client)."""

    #: The class's name in messages.
    _kind = "RedisLock"
    #: Who owns a reentrant acquisition, in messages.
    _owner_name = "the calling thread"
    #: This process's reentrant holds of this kind of lock (see ``owners.py``).
    _holds: Holds[H]
    #: The owner token of the caller (a thread, or an asyncio task).
    _owner: Callable[[], object]
    #: The store shared by every lock on a client's connection pool.
    _shared_store: Callable[[Any], S]
    #: Takes a value back in the background: ``(store, name, value, now=...)``.
    _take_back: Callable[..., Any]

    def __init__(
        self,
        client: C,
        name: str,
        ttl: float = 30.0,
        renew: bool = True,
        *,
        blocking: bool = True,
        timeout: float | None = None,
        store: S | None = None,
        reentrant: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"{self._kind} name must be a non-empty str, got {name!r}")
        self.name = name
        self.ttl = validate_ttl(ttl, f"{self._kind} ttl")
        self.renew = validate_flag(renew, f"{self._kind} renew")
        self.blocking = validate_flag(blocking, f"{self._kind} blocking")
        self.timeout = validate_wait_timeout(timeout, f"{self._kind} timeout")
        self.reentrant = validate_flag(reentrant, f"{self._kind} reentrant")
        self.client = client
        self.backend: S = self._shared_store(client) if store is None else store
        self.handle: H | None = None
        self._last_contention = _NO_CONTENTION

    def __repr__(self) -> str:
        try:
            state = "held" if self.owned else "free"
        except RuntimeError:  # reentrant asyncio, no running loop: no task to ask for
            state = "reentrant"
        return f"<{self._kind} {self.name!r} {state}>"

    def _hold(self) -> Hold[H] | None:
        return self._holds.get(self.backend, self.name, self._owner())

    def _current(self, owner: object = None) -> H | None:
        if not self.reentrant:
            return self.handle
        hold = self._holds.get(self.backend, self.name, self._owner() if owner is None else owner)
        return None if hold is None else hold.handle

    def _held(self, owner: object = None) -> H:
        """The current acquisition (reentrant: ``owner``'s, default the caller's).

        Raises:
            LockNotOwned: there is none.
        """
        handle = self._current(owner)
        if handle is None:
            holder = self._owner_name if self.reentrant else "this object"
            raise LockNotOwned(self.name, f"it is not held by {holder}")
        return handle

    def _own_hold(self, owner: object) -> Hold[H]:
        """``owner``'s hold, for its release.

        Raises:
            LockNotOwned: ``owner`` does not hold it.
        """
        hold = self._holds.get(self.backend, self.name, owner)
        if hold is None:
            raise LockNotOwned(
                self.name,
                f"{self._owner_name} does not hold it (released more times than acquired?)",
            )
        return hold

    @property
    def owned(self) -> bool:
        """True while this object (reentrant: the caller) holds the lock (no round trip)."""
        handle = self._current()
        return handle is not None and handle.owned

    @property
    def lost(self) -> bool:
        """True when the renewer found the lock gone or taken over while held."""
        handle = self._current()
        return handle is not None and handle.lost

    @property
    def depth(self) -> int:
        """How many times it is held (reentrant: by the caller); 0 when not held."""
        if not self.reentrant:
            return 1 if self.handle is not None and not self.handle.released else 0
        hold = self._hold()
        return 0 if hold is None else hold.depth

    def _check_nested(self, hold: Hold[H]) -> None:
        """A nested acquire may go on (it then extends): raise if the outer one was lost."""
        if hold.handle.lost:
            raise LockNotOwned(
                self.name, f"the outer acquisition was lost ({hold.handle.lost_reason})"
            )

    def _new_try(
        self, blocking: bool | None, timeout: float | None
    ) -> tuple[bool, float | None, str, int, float, tuple[str, ...]]:
        """A new outermost acquire: its blocking, timeout, value, TTL in ms, start, adopt.

        Raises:
            RuntimeError: this (non-reentrant) object already holds the lock.
        """
        if not self.reentrant and self.handle is not None and not self.handle.released:
            raise RuntimeError(f"{self._kind} {self.name!r} is already held by this object")
        value = LockValue.new_encoded(LockOwner.current(None, 0, None), self.name)
        return (
            self.blocking if blocking is None else validate_flag(blocking, "blocking"),
            self.timeout if timeout is None else validate_wait_timeout(timeout, "timeout"),
            value,
            max(int(self.ttl * 1000), 1),
            clock(),
            _unsettled(self.backend, self.name),
        )

    # What an outermost acquire's outcome means, decided here once; the
    # drivers (lock.py, aiolock.py) do the I/O between these steps, each in
    # its own try block, so an interruption anywhere is theirs to undo.

    def _granted(
        self,
        handle: H,
        owner: object,
        adopt: tuple[str, ...],
        started: float,
        fence: int | None,
        scoped: bool = False,
    ) -> None:
        """Keep a granted acquisition, renew it, forget what it took over, announce it.

        The driver assigned ``handle`` to its own variable first: an
        interruption in here leaves it something to release.
        """
        if self.reentrant:
            self._holds.add(self.backend, self.name, owner, handle)
        else:
            self.handle = handle
        if self.renew:
            # A reentrant hold, not this object, keeps the handle (another
            # lock of the name may release it): the renewer holds it strongly.
            self._start_renewal(handle, scoped and not self.reentrant)
        if adopt:
            _settle(self.backend, self.name, adopt)
        signals.lock_acquired.send(
            sender=self,
            key=self.name,
            task_name=self.name,
            task_id=None,
            waited=clock() - started,
            fence=fence,
        )

    def _start_renewal(self, handle: H, scoped: bool) -> None:
        """Hand a granted acquisition to the renewer (``scoped``: held weakly, see lease.py)."""
        raise NotImplementedError

    def _contended(self, result: AcquireResult) -> bool:
        """Not acquired: send ``lock_contended``, remember who holds it; False."""
        signals.lock_contended.send(
            sender=self,
            key=self.name,
            task_name=self.name,
            task_id=None,
            holder_task_id=result.holder_task_id,
            ttl_remaining=result.known_ttl,
            policy="not_acquired",
        )
        self._last_contention = result
        return False

    def _failed(self, error: BaseException, handle: H | None, owner: object, value: str) -> bool:
        """An outermost acquire of ``value`` raised ``error``: must the driver give it back now?

        Redis answering too late (``LockBackendError`` before a grant) is not
        a refusal: the command may still run. The next acquire of this name
        in this process takes ``value`` over instead of waiting out its TTL;
        if none comes, it is taken back in the background. Anything else
        (an interruption between sending the acquire and reading its reply,
        or after the grant, before returning) leaves the outcome unknown:
        the caller will not release what acquire() did not report, so this
        acquisition is forgotten and the driver takes its value back out
        (``handle``: granted, release it) before re-raising.
        """
        if handle is None and isinstance(error, LockBackendError):
            _note_unsettled(self.backend, self.name, value)
            self._take_back(self.backend, self.name, value, now=False)
            return False
        self.handle = None
        if self.reentrant and handle is not None:
            self._holds.remove(self.backend, self.name, owner, handle)
        return True

    def _copy(self, make: Callable[..., L]) -> L:
        """A fresh lock with this one's settings (one per decorated call)."""
        return make(
            self.client,
            self.name,
            self.ttl,
            self.renew,
            blocking=self.blocking,
            timeout=self.timeout,
            store=self.backend,
            reentrant=self.reentrant,
        )
