"""Lock keys: canonical, type-tagged argument encoding and key building (no I/O).

A key is ``<prefix>:<task name>:{<digest>}``. The digest is a 128-bit BLAKE2b
hash of a canonical encoding of the call's arguments bound to the task's
``run`` signature, so every call shape of one logical call gives one key:

* ``f(1)``, ``f(a=1)`` and ``f(1, b=<default>)`` bind to the same arguments;
* keyword order never matters (mappings are encoded sorted);
* a tuple and a list encode alike, because JSON turns one into the other
  between producer and worker;
* mapping keys are encoded as JSON object keys (``{1: x}`` == ``{"1": x}``),
  again because that is what the worker receives;
* values carry a type tag, so ``1``, ``1.0``, ``True`` and ``"1"`` differ, and
  ``None`` differs from ``"None"``;
* UUID, datetime, date, time, Decimal and bytes are encoded by value, matching
  kombu's JSON round trip.

Anything else (an object whose only text form is a repr with a memory
address) raises :class:`LockKeyError` rather than silently giving a key that
differs between processes.
"""

from __future__ import annotations

import datetime
import decimal
import functools
import hashlib
import inspect
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery_redislock.exceptions import LockKeyError

# The companions' names, here for the callers that look for them here.
from celery_redislock.key_family import (
    HANDOFF_SUFFIXES,
    NOT_LOCK_SUFFIXES,
    KeyFamily,
    debounce_key,
    fence_key,
    handoff_keys,
    next_run_key,
    queued_key,
    release_channel,
    slot_key,
    slot_keys,
    split_slot,
)

__all__ = [
    "HANDOFF_SUFFIXES",
    "KEY_FORMAT_VERSION",
    "NOT_LOCK_SUFFIXES",
    "KeyFamily",
    "argument_digest",
    "bind_lock_arguments",
    "canonical_encoding",
    "custom_key",
    "debounce_key",
    "fence_key",
    "handoff_keys",
    "next_run_key",
    "pending_keys",
    "plain_parameter_names",
    "queued_key",
    "release_channel",
    "revocable_key",
    "slot_key",
    "slot_keys",
    "split_slot",
    "task_key",
]

#: Bumped whenever the encoding changes, so old and new workers never share
#: a key by accident during a rolling upgrade. 2: float subclasses encode as
#: plain floats; non-finite float mapping keys are spelled as JSON spells them.
KEY_FORMAT_VERSION = 2

_MAX_DEPTH = 64


def canonical_encoding(value: Any, path: str = "argument") -> bytes:
    """Return the canonical, type-tagged byte encoding of ``value``.

    Args:
        value: The value to encode.
        path: How to name ``value`` in error messages.

    Raises:
        LockKeyError: ``value`` (or something nested in it) has no stable
            encoding.
    """
    out: list[bytes] = []
    _encode(value, out, 0, path)
    return b"".join(out)


def _length_prefixed(tag: bytes, data: bytes) -> bytes:
    return tag + str(len(data)).encode() + b":" + data


def _encode(value: Any, out: list[bytes], depth: int, path: str) -> None:
    if depth > _MAX_DEPTH:
        raise LockKeyError(f"{path} is nested more than {_MAX_DEPTH} levels deep")
    # bool before int: bool is a subclass of int but must not equal 1.
    if value is None:
        out.append(b"N")
    elif value is True:
        out.append(b"T")
    elif value is False:
        out.append(b"F")
    elif isinstance(value, int):
        out.append(b"i" + str(int(value)).encode() + b";")
    elif isinstance(value, float):
        out.append(b"f" + _float_text(value).encode() + b";")
    elif isinstance(value, str):
        out.append(_length_prefixed(b"s", value.encode("utf-8", "surrogatepass")))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        out.append(_length_prefixed(b"y", bytes(value)))
    elif isinstance(value, uuid.UUID):
        out.append(b"u" + value.hex.encode() + b";")
    elif isinstance(value, datetime.datetime):
        out.append(_length_prefixed(b"t", value.isoformat().encode()))
    elif isinstance(value, datetime.date):
        out.append(_length_prefixed(b"d", value.isoformat().encode()))
    elif isinstance(value, datetime.time):
        out.append(_length_prefixed(b"h", value.isoformat().encode()))
    elif isinstance(value, decimal.Decimal):
        out.append(_length_prefixed(b"D", str(value).encode()))
    elif isinstance(value, Mapping):
        _encode_mapping(value, out, depth, path)
    elif isinstance(value, (list, tuple)):
        out.append(b"[" + str(len(value)).encode() + b":")
        for index, item in enumerate(value):
            _encode(item, out, depth + 1, f"{path}[{index}]")
        out.append(b"]")
    elif isinstance(value, (set, frozenset)):
        items = []
        for item in value:
            encoded: list[bytes] = []
            _encode(item, encoded, depth + 1, f"{path} item")
            items.append(b"".join(encoded))
        items.sort()
        out.append(b"<" + str(len(items)).encode() + b":" + b"".join(items) + b">")
    else:
        raise LockKeyError(
            f"{path} of type {type(value).__module__}.{type(value).__qualname__} has no "
            "stable encoding for a lock key; pass JSON-like values (str, int, float, bool, "
            "None, list, dict, UUID, datetime, Decimal, bytes) or set lock_args/lock_key "
            "to leave it out of the key"
        )


def _float_text(value: float) -> str:
    if math.isnan(value):
        return "nan"
    # float's own repr, not the value's: a subclass (NumPy's float64) may
    # print itself differently, and reaches the worker as a plain float.
    # It is the shortest text that round-trips, and JSON keeps it exactly.
    return float.__repr__(value)


def _json_float_key(value: float) -> str:
    # What json.dumps writes for a float mapping key.
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return float.__repr__(value)


def _mapping_key_text(key: Any, path: str) -> str:
    # What json.dumps would write as the object key: the worker only ever
    # sees these strings, so the producer must hash them the same way.
    if isinstance(key, str):
        return key
    if key is True:
        return "true"
    if key is False:
        return "false"
    if key is None:
        return "null"
    if isinstance(key, int):
        return str(int(key))
    if isinstance(key, float):
        return _json_float_key(key)
    raise LockKeyError(
        f"{path} has a mapping key of type {type(key).__qualname__}; only str, int, float, "
        "bool and None keys survive a JSON round trip"
    )


def _encode_mapping(value: Mapping[Any, Any], out: list[bytes], depth: int, path: str) -> None:
    entries: dict[str, Any] = {}
    for raw_key, item in value.items():
        text = _mapping_key_text(raw_key, path)
        if text in entries:
            raise LockKeyError(f"{path} has two keys that are both {text!r} after JSON encoding")
        entries[text] = item
    out.append(b"{" + str(len(entries)).encode() + b":")
    for text in sorted(entries):
        out.append(_length_prefixed(b"k", text.encode("utf-8", "surrogatepass")))
        _encode(entries[text], out, depth + 1, f"{path}[{text!r}]")
    out.append(b"}")


def argument_digest(task_name: str, arguments: Mapping[str, Any]) -> str:
    """Return the 128-bit hex digest of a task's bound arguments."""
    hasher = _named_hasher(task_name).copy()
    for name in sorted(arguments):
        hasher.update(_argument_name(name))
        hasher.update(canonical_encoding(arguments[name], f"{task_name}: argument {name!r}"))
    return hasher.hexdigest()


@functools.lru_cache(maxsize=1024)
def _named_hasher(task_name: str) -> hashlib.blake2b:
    # Copied for each call, never updated itself: a copy of a hasher that
    # has the task name costs half of a new one (measured 1.3 µs against
    # 2.4 µs per digest of one argument).
    hasher = hashlib.blake2b(digest_size=16, person=b"redislock-v%d" % KEY_FORMAT_VERSION)
    hasher.update(_length_prefixed(b"n", task_name.encode()))
    return hasher


@functools.lru_cache(maxsize=1024)
def _argument_name(name: str) -> bytes:
    return _length_prefixed(b"a", name.encode())


def bind_lock_arguments(
    signature: inspect.Signature,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    lock_args: Sequence[str] | None,
    task: str,
    plain_names: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Bind a call to ``signature`` and keep the arguments that make up the key.

    Args:
        signature: The signature of the task's ``run`` (without ``self``).
        args: Positional arguments of the call.
        kwargs: Keyword arguments of the call.
        lock_args: Parameter names to keep; ``None`` keeps all of them and an
            empty sequence keeps none (the key is the task name alone).
        task: Task name, for error messages.
        plain_names: :func:`plain_parameter_names` of ``signature``, if
            computed once beforehand: a call passing exactly these
            positionally then binds without ``Signature.bind``.

    Raises:
        LockKeyError: the arguments do not fit the signature.
    """
    if plain_names is not None and not kwargs and len(args) == len(plain_names):
        # The common call, bound without ``Signature.bind`` (4 µs of the
        # lock's per-task cost, measured with cProfile over 5,000 tasks).
        arguments = dict(zip(plain_names, args, strict=True))
        return arguments if lock_args is None else {name: arguments[name] for name in lock_args}
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise LockKeyError(f"{task}: arguments do not match run(): {exc}") from exc
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    if lock_args is None:
        return arguments
    return {name: arguments[name] for name in lock_args}


def plain_parameter_names(signature: inspect.Signature) -> tuple[str, ...] | None:
    """The parameter names, if every parameter is positional-or-keyword without a default.

    Such a signature binds a call with one positional argument per parameter
    and no keywords by position alone: ``bind_lock_arguments`` skips
    ``Signature.bind`` for it. ``None`` for any other signature.
    """
    parameters = signature.parameters.values()
    if all(
        p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.default is inspect.Parameter.empty
        for p in parameters
    ):
        return tuple(signature.parameters)
    return None


def task_key(prefix: str, task_name: str, arguments: Mapping[str, Any]) -> KeyFamily:
    """Return ``<prefix>:<task name>:{<digest>}`` for bound arguments, as its family."""
    return KeyFamily(f"{prefix}:{task_name}:{{{argument_digest(task_name, arguments)}}}")


def custom_key(
    prefix: str,
    key_function: Callable[[tuple[Any, ...], dict[str, Any]], str],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    task: str,
) -> KeyFamily:
    """Return ``<prefix>:{<user key>}`` from a user's ``lock_key`` callable.

    The task name is deliberately left out, so tasks that return the same
    string share one lock (e.g. ``sync_account`` and ``close_account`` for
    one account).

    Raises:
        LockKeyError: the callable did not return a non-empty ``str``.
    """
    value = key_function(tuple(args), dict(kwargs))
    if not isinstance(value, str) or not value:
        raise LockKeyError(f"{task}: lock_key must return a non-empty str, it returned {value!r}")
    return KeyFamily(f"{prefix}:{{{value}}}")


def pending_keys(prefix: str, app: str) -> tuple[str, str]:
    """Return the keys of an app's pending calls: the index and the outbox, one slot.

    ``<prefix>:{pending:<app>}:index``, a sorted set: member -> when (server
    ms) a sweep should look at it (``pending.py``); ``...:outbox``, a hash:
    id -> a message to publish. One pair per app (its main name): a sweep
    publishes through its own app's broker. Under the prefix (an ACL's
    ``~<prefix>:*``), one hash tag (one script may touch both on a cluster);
    no lock key ends with ``:index`` or ``:outbox`` (a task key ends with its tag).
    """
    stem = _pending_stem(prefix, app)
    return f"{stem}index", f"{stem}outbox"


def revocable_key(prefix: str, app: str, task_id: str, kind: str = "revocable") -> str:
    """Call ``task_id``'s record (its countdown waits in the broker) or ``revoked`` mark."""
    return f"{_pending_stem(prefix, app)}{task_id}:{kind}"


def _pending_stem(prefix: str, app: str) -> str:
    name = app.replace("{", "(").replace("}", ")")
    return f"{prefix}:{{pending:{name}}}:"
