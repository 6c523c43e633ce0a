"""A lock key's family: every key kept beside a lock, named from the lock key (no I/O).

Beside a lock key live its fence counter, its parked executions (waiters,
parked, ran), its queued-run marker and record, its debounce record, its
release channel and, with ``lock_limit``, its slots: all in the lock key's
Redis Cluster slot, so one script can touch them together. The names are
made here only: :class:`KeyFamily` (what the keys module builds once per
execution and hands down) names each on first use, and the stores read
them from it instead of deriving any (:func:`family_of`).
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Callable
from typing import Generic, TypeVar, overload

from redis.crc import key_slot

T = TypeVar("T")

__all__ = [
    "HANDOFF_SUFFIXES",
    "NOT_LOCK_SUFFIXES",
    "KeyFamily",
    "debounce_key",
    "family_of",
    "fence_key",
    "handoff_keys",
    "next_run_key",
    "plain_key",
    "queued_key",
    "release_channel",
    "slot_key",
    "slot_keys",
    "split_slot",
]


def _companion(key: str, suffix: str) -> str:
    """Return ``key`` + ``suffix`` in the same Redis Cluster slot as ``key``.

    A key with a hash tag (``...{tag}...``) keeps it; any other key becomes
    the tag itself (``{key}:suffix``), which Redis hashes exactly as ``key``.
    Every slot of a ``lock_limit`` key shares its base key's companions
    (fence counter, hand-off keys), so fences keep increasing across slots.
    """
    return _companion_stem(key) + suffix


def _companion_stem(key: str) -> str:
    """What :func:`_companion` puts before the suffix: ``key:``, ``{key}:`` or ``{tag}:key:``.

    A key with no hash tag that holds a ``}`` (``a}b``, ``{}``) is hashed
    whole by Redis Cluster, and no ``{...}`` can hold it: its companions
    carry a tag of the key's own slot instead (review: they were refused
    with ``CROSSSLOT``, so its fence, waits and releases failed).
    """
    key = split_slot(key)[0]
    if _has_hash_tag(key):
        return f"{key}:"
    if "}" not in key:
        return f"{{{key}}}:"
    return f"{{{_slot_tag(key_slot(key.encode()))}}}:{key}:"


def _has_hash_tag(key: str) -> bool:
    """Whether Redis Cluster hashes ``key`` by a tag: a non-empty ``{...}``, the first ``{`` on."""
    start = key.find("{")
    return start >= 0 and key.find("}", start + 1) > start + 1


_CLUSTER_SLOTS = 16384
#: For each Redis Cluster slot, the smallest number whose text hashes to it
#: (filled on the first key that needs it: 110,000 CRC16s, 55 ms). No lock:
#: two threads filling it at once fill it alike (a lock held by another
#: thread at a fork would stay held in the child).
_SLOT_TAGS: list[int] = []


def _slot_tag(slot: int) -> str:
    """A hash tag that Redis Cluster maps to ``slot``."""
    if not _SLOT_TAGS:
        tags = [-1] * _CLUSTER_SLOTS
        missing, number = _CLUSTER_SLOTS, 0
        while missing:
            # key_slot's CRC without its hash-tag parsing (no brace in a number).
            slot_of = binascii.crc_hqx(b"%d" % number, 0) % _CLUSTER_SLOTS
            if tags[slot_of] < 0:
                tags[slot_of] = number
                missing -= 1
            number += 1
        _SLOT_TAGS[:] = tags  # at once: no thread sees it half filled
    return str(_SLOT_TAGS[slot])


def fence_key(key: str) -> str:
    """Return the key of ``key``'s fence counter, in the same Redis Cluster slot."""
    return _companion(key, "fence")


#: Suffixes of the keys that hold parked executions (see :func:`handoff_keys`).
HANDOFF_SUFFIXES = ("waiters", "parked", "ran")
#: Suffixes of every key kept beside a lock that is not a lock itself
#: ("parking": a flag of versions before the waiting mark, tokens.WAITING).
NOT_LOCK_SUFFIXES = (
    "fence",
    "debounce",
    "next",
    "index",
    "outbox",
    "parking",
    "revocable",
    *HANDOFF_SUFFIXES,
)


def handoff_keys(key: str) -> tuple[str, str, str]:
    """Return the keys of ``key``'s parked executions, in its Redis Cluster slot.

    * ``waiters``: a list of hand-off values, in the order they parked;
    * ``parked``: a hash, hand-off value -> the message to publish when the
      lock is handed to it (kept until a copy of the call is granted);
    * ``ran``: a hash of the hand-off values whose execution was granted the
      lock (value: which copy), so a second copy of it is dropped.

    A parked call marks its holder's value (``tokens.WAITING``): a release
    reads these keys only then, so a lock store user that never parks needs
    no list or hash commands.
    """
    stem = _companion_stem(key)
    return stem + "waiters", stem + "parked", stem + "ran"


def next_run_key(key: str) -> str:
    """Return the record of ``key``'s queued run (``lock_enqueue="until_start"``).

    A hash: its queued token, hand-off value, message, next copy's due time.
    """
    return _companion(key, "next")


def debounce_key(key: str) -> str:
    """Return the key of ``key``'s debounce record (``lock_debounce``)."""
    return _companion(key, "debounce")


def queued_key(key: str) -> str:
    """Return the key that marks "a run of ``key`` is queued and not started" (coalescing)."""
    return _companion(key, "queued")


def release_channel(key: str) -> str:
    """The pub/sub channel of ``key``'s releases (a slot's: its base key's, for any waiter)."""
    return f"{split_slot(key)[0]}:released"


#: ``<base key>:slot:<n>``, n >= 2. A base key of a lock that may have slots
#: (a task key) always ends with its hash tag's ``}``, so a slot suffix
#: can never be mistaken for part of a base key.
_SLOT_KEY = re.compile(r"^(?P<base>.*\}):slot:(?P<slot>[1-9][0-9]*)$", re.DOTALL)


def slot_key(key: str, slot: int) -> str:
    """Return the key of ``key``'s ``slot``-th slot (``lock_limit``); slot 1 is ``key`` itself.

    Slots 2..N append ``:slot:<n>`` after the key's hash tag, so all slots
    (and the fence counter) share one Redis Cluster hash slot and one
    script can look at all of them.

    Raises:
        ValueError: ``slot`` < 1, or a slot > 1 of a key without a hash tag
            at its end (task keys always have one).
    """
    if slot < 1:
        raise ValueError(f"slot must be >= 1, got {slot}")
    if slot == 1:
        return key
    if not key.endswith("}") or "{" not in key:
        raise ValueError(f"key {key!r} has no hash tag at its end; it cannot have slots")
    return f"{key}:slot:{slot}"


def slot_keys(key: str, limit: int) -> list[str]:
    """Return the keys of slots 1..``limit`` of ``key``."""
    return [slot_key(key, slot) for slot in range(1, limit + 1)]


def split_slot(key: str) -> tuple[str, int]:
    """Return ``(base key, slot number)`` of a key; any other key is its own slot 1."""
    if ":slot:" not in key:  # most keys: no regex (measured 0.6 µs -> 0.05 µs)
        return key, 1
    match = _SLOT_KEY.match(key)
    if match is None or int(match["slot"]) < 2 or "{" not in match["base"]:
        return key, 1  # not a slot: slot_key() gives none to a base without "{"
    return match["base"], int(match["slot"])


class _Named(Generic[T]):
    """A companion, named on a family's first use and kept in its ``__dict__``.

    Not ``functools.cached_property``: before Python 3.12 it takes one lock
    shared by every instance, so all threads naming any family's companion
    take turns, and a fork while another thread holds it (the renewer
    thread names fence keys) leaves the child's copy of it held for ever.
    Two threads naming one companion at once store equal strings.
    """

    def __init__(self, name: Callable[[str], T]) -> None:
        self._name = name
        self._attribute = ""

    def __set_name__(self, owner: type, attribute: str) -> None:
        self._attribute = attribute

    @overload
    def __get__(self, family: None, owner: type | None = None) -> _Named[T]: ...

    @overload
    def __get__(self, family: KeyFamily, owner: type | None = None) -> T: ...

    def __get__(self, family: KeyFamily | None, owner: type | None = None) -> T | _Named[T]:
        if family is None:
            return self
        value = family.__dict__[self._attribute] = self._name(family)
        return value


class KeyFamily(str):
    """A lock key (this ``str`` itself) and every key kept beside it, each named once.

    A ``str`` equal to the lock key, so every API that takes a lock key
    takes a family unchanged (a store subclass's ``do_*`` overrides
    included), and a family and the plain key are one dict key. The
    companions are named on first use and kept: an execution builds its
    family once (``keys.task_key``) and every layer below reads from it.
    A slot key's family names its base key's companions (one fence counter,
    one set of parked executions, one release channel for every slot).
    """

    #: The fence counter (see :func:`fence_key`).
    fence = _Named(fence_key)
    #: The parked executions' keys: waiters, parked, ran (see :func:`handoff_keys`).
    handoff = _Named(handoff_keys)
    #: The queued-run marker (see :func:`queued_key`).
    queued = _Named(queued_key)
    #: The queued run's record (see :func:`next_run_key`).
    next_run = _Named(next_run_key)
    #: The debounce record (see :func:`debounce_key`).
    debounce = _Named(debounce_key)
    #: The release channel (see :func:`release_channel`).
    channel = _Named(release_channel)

    def slots(self, limit: int) -> list[str]:
        """The keys of slots 1..``limit`` (see :func:`slot_keys`)."""
        return slot_keys(self, limit)

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        # Pickled (a result, a message, a signal receiver's queue) it is the
        # plain key: a process without this class (an older version) reads
        # it, and nothing outside this process needs the named companions.
        return str, (plain_key(self),)


def _yaml_writes_families_as_keys() -> None:
    """Let yaml's safe dumper write a family as the plain key (kombu's yaml serializer).

    A family reaches user code (``self.lock.key``, signal arguments), which
    may return or send it: ``yaml.safe_dump`` refuses ``str`` subclasses it
    was not told about. PyYAML is imported by kombu already when installed.
    """
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - PyYAML is optional
        return
    yaml.SafeDumper.add_representer(KeyFamily, yaml.SafeDumper.represent_str)


_yaml_writes_families_as_keys()


def family_of(key: str) -> KeyFamily:
    """``key``'s family: ``key`` itself when it is one (built once, upstream), else a new one.

    A key of another ``str`` subclass (a ``(str, Enum)`` member) names its
    family by its value, the text sent to Redis as the key, not its ``str()``.
    """
    return key if type(key) is KeyFamily else KeyFamily(str.__str__(key))


def plain_key(key: str) -> str:
    """``key`` as a plain ``str`` (its value): for what leaves the process.

    A result or an exception crossing to another process carries the key as
    a plain ``str``: kombu's yaml serializer refuses ``str`` subclasses.
    """
    return str.__str__(key)
