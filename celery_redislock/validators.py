"""Validators of setting and task-option values: each returns the value to use or raises.

Every validator has the signature ``validate(value, where) -> value``:
``where`` names the setting or the task option as the user spelled it, and
every :class:`ConfigurationError` message starts with it, says what is
wrong, shows the value, and (for a name or a value close to a known one)
says what was probably meant.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from difflib import get_close_matches
from typing import Any

from celery.utils.imports import symbol_by_name

from celery_redislock.clients import URL_SCHEMES, check_options, check_url, url_error_detail
from celery_redislock.exceptions import ConfigurationError
from celery_redislock.policies import ContentionPolicy, resolve_policy
from celery_redislock.store import LockStore
from celery_redislock.urls import mask_url

__all__ = [
    "BACKEND_ERROR_MODES",
    "ENQUEUE_MODES",
    "LOST_MODES",
    "MAX_SECONDS",
    "check_debounce_combination",
    "check_limit_combination",
    "did_you_mean",
    "unknown_option_errors",
    "validate_backend_error_mode",
    "validate_count",
    "validate_debounce",
    "validate_enqueue_mode",
    "validate_flag",
    "validate_hold",
    "validate_key_prefix",
    "validate_limit",
    "validate_lock_args",
    "validate_lost_mode",
    "validate_max_wait",
    "validate_policy",
    "validate_redis_options",
    "validate_store_class",
    "validate_ttl",
    "validate_url",
]


#: The longest duration a setting may give: about 317 years (1e10 s), so
#: a "once per key, ever" window still fits. Redis refused the milliseconds
#: of 1e17 s (every acquire failed), and a script's Lua number prints in
#: exponent form from 1e14 on, which Redis would refuse as a TTL: 1e10 s is
#: 1e13 ms, room for the sums and the tenfold default of debounce_max_wait.
MAX_SECONDS = 10_000_000_000


def validate_ttl(ttl: Any, where: str) -> float:
    """Return ``ttl`` as seconds, or raise :class:`ConfigurationError`."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise ConfigurationError(f"{where} must be a number of seconds, got {ttl!r}")
    if not ttl > 0 or ttl != ttl or ttl == float("inf"):
        raise ConfigurationError(
            f"{where} must be a positive, finite number of seconds, got {ttl!r}"
        )
    if ttl < 0.01:
        raise ConfigurationError(f"{where} must be at least 0.01 seconds, got {ttl!r}")
    if ttl > MAX_SECONDS:
        raise ConfigurationError(
            f"{where} must be at most {MAX_SECONDS} seconds (about 317 years), got {ttl!r}"
        )
    return float(ttl)


def validate_wait_timeout(timeout: Any, where: str) -> float | None:
    """Return a blocking wait's longest time in seconds, or None (as long as it takes)."""
    if timeout is None:
        return None
    number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not number or not 0 <= timeout < float("inf"):
        raise ConfigurationError(
            f"{where} must be None (wait as long as it takes) or a finite number of seconds "
            f">= 0, got {timeout!r}"
        )
    return float(timeout)


BACKEND_ERROR_MODES = ("fail", "run")


def unknown_option_errors(defined: Mapping[str, Any], options: Sequence[str]) -> list[str]:
    """One message per name in ``defined`` that is not one of ``options``, with the closest one.

    ``lock_*`` names on a task class are the options' (a typo of one must
    not pass as an attribute of the user's own): see ``task.py``.
    """
    # Compared without the common "lock_", which would make every name look close.
    bare = {option.removeprefix("lock_"): option for option in options}
    errors = []
    for name, value in sorted(defined.items()):
        if name in options:
            continue
        shown = name if callable(value) else f"{name}={value!r}"
        guesses = get_close_matches(name.removeprefix("lock_"), list(bare), n=1, cutoff=0.6)
        if not guesses:  # "locks_args": the prefix itself misspelled
            whole = get_close_matches(name, list(options), n=1, cutoff=0.85)
            guesses = [option.removeprefix("lock_") for option in whole]
        if guesses:
            hint = f"; did you mean {bare[guesses[0]]}?"
        else:
            hint = f" (the options: {', '.join(options)}; lock_* names are reserved for them)"
        errors.append(f"{shown} is not a celery-redislock task option{hint}")
    return errors


def did_you_mean(value: Any, choices: Sequence[str]) -> str:
    """``"; did you mean 'x'?"`` when ``value`` is a string close to one of ``choices``."""
    if not isinstance(value, str):
        return ""
    guesses = get_close_matches(value.lower(), list(choices), n=1, cutoff=0.6)
    return f"; did you mean {guesses[0]!r}?" if guesses else ""


def validate_backend_error_mode(value: Any, where: str) -> str:
    """Return ``value`` if it is ``"fail"`` or ``"run"``, else raise."""
    if value not in BACKEND_ERROR_MODES:
        raise ConfigurationError(
            f"{where} must be 'fail' or 'run', got {value!r}"
            + did_you_mean(value, BACKEND_ERROR_MODES)
        )
    return str(value)


LOST_MODES = ("report", "abort")


def validate_lost_mode(value: Any, where: str) -> str:
    """Return ``value`` if it is ``"report"`` or ``"abort"``, else raise."""
    if value not in LOST_MODES:
        raise ConfigurationError(
            f"{where} must be 'report' or 'abort', got {value!r}" + did_you_mean(value, LOST_MODES)
        )
    return str(value)


def validate_count(value: Any, where: str) -> int:
    """Return ``value`` if it is an int >= 0, else raise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"{where} must be an int >= 0, got {value!r}")
    return value


#: The values of ``lock_enqueue``: off, held until the run ends, held until it starts.
ENQUEUE_MODES = ("off", "until_done", "until_start")


def validate_enqueue_mode(value: Any, where: str) -> str:
    """Return the enqueue-time dedup mode: ``"off"``, ``"until_done"`` or ``"until_start"``.

    ``False``/``True`` are ``"off"``/``"until_done"`` (the original meaning).
    """
    if value is None or (isinstance(value, int) and value in (0, 1)):  # bools too
        return "until_done" if value else "off"
    if isinstance(value, str) and value in ENQUEUE_MODES:
        return value
    raise ConfigurationError(
        f"{where} must be False, True, 'until_done' or 'until_start', got {value!r}"
        + (did_you_mean(value, ENQUEUE_MODES) or _bool_hint(value))
    )


def validate_debounce(value: Any, where: str) -> float:
    """Return a debounce window in seconds (0 = off), else raise."""
    return validate_hold(value, where)


def validate_max_wait(value: Any, where: str) -> float | None:
    """Return a debounce cap in seconds, or None (ten windows), else raise."""
    return None if value is None else validate_ttl(value, where)


def validate_limit(value: Any, where: str) -> int:
    """Return ``value`` if it is an int >= 1 (executions per key at once), else raise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"{where} must be a positive int (executions per key at once), got {value!r}"
        )
    return value


def check_limit_combination(limit: int, enqueue: bool, hold: float, where: str) -> None:
    """Refuse the settings not defined together with ``lock_limit`` > 1.

    ``lock_enqueue`` deduplicates a call against the one queued or running
    call of its key, and ``lock_hold_after_success`` keeps that one call's
    window: neither says what it means with N slots, so the combination is
    refused rather than given a meaning nobody asked for. (Coalescing,
    ``lock_enqueue="until_start"``, keeps one *queued* call per key, which
    runs when any slot frees: allowed, as are ``HandOff`` and debounce.)

    Raises:
        ConfigurationError: ``limit`` > 1 with either of them on.
    """
    if limit <= 1:
        return
    if enqueue:
        raise ConfigurationError(
            f"{where}: lock_limit={limit} cannot be combined with lock_enqueue=True "
            "(it keeps one queued or running call per key; lock_enqueue='until_start' "
            "works with slots); turn one of them off"
        )
    if hold:
        raise ConfigurationError(
            f"{where}: lock_limit={limit} cannot be combined with lock_hold_after_success "
            "(the idempotency window is one kept value per key); turn one of them off"
        )


def check_debounce_combination(debounce: float, enqueue: bool, where: str) -> None:
    """Refuse ``lock_debounce`` with ``lock_enqueue``, however each was set.

    Raises:
        ConfigurationError: both on (a debounced call already joins the
            burst's one run; the enqueue lock would never be taken).
    """
    if debounce and enqueue:
        raise ConfigurationError(
            f"{where}: set lock_debounce or lock_enqueue, not both (a debounced call "
            "already joins the burst's run; under an app-wide redislock_enqueue, give the "
            "debounced task lock_enqueue=False)"
        )


def debounce_wait_error(debounce: tuple[str, float], max_wait: tuple[str, float | None]) -> str:
    """What is wrong with a debounce cap shorter than its window (each a ``(name, value)``).

    Returns the message, or "" when nothing is: with a shorter cap, every
    burst would run at the cap, never a window after its last call.
    """
    (debounce_name, window), (wait_name, cap) = debounce, max_wait
    if not window or cap is None or cap >= window:
        return ""
    return (
        f"{wait_name}={cap:g} is shorter than {debounce_name}={window:g}: every burst would "
        f"run {cap:g} s after its first call, never {window:g} s after its last; make it at "
        "least the window (unset: ten windows)"
    )


def check_unused_options(set_by_task: Mapping[str, bool], where: str) -> None:
    """Refuse a task option that the task's other settings leave without effect.

    ``set_by_task``: option name -> whether the option it needs is on.

    Raises:
        ConfigurationError: naming the option and the one it needs.
    """
    needs = {"lock_debounce_max_wait": "lock_debounce", "lock_enqueue_raise": "lock_enqueue"}
    for option, needed_is_on in set_by_task.items():
        if not needed_is_on:
            raise ConfigurationError(
                f"{where}: {option} is set but {needs[option]} is off, so it would do "
                f"nothing; turn {needs[option]} on, or remove {option}"
            )


def validate_hold(value: Any, where: str) -> float:
    """Return ``value`` as seconds >= 0 (0 turns it off: no window, no kept counter), else raise."""
    if value == 0:  # False too: "no window"
        return 0.0
    return validate_ttl(value, where)


def validate_flag(value: Any, where: str) -> bool:
    """Return ``value`` if it is a bool (or the int 0 or 1), else raise.

    A string such as ``"false"`` (an environment variable read as it is)
    would be true, so it is refused rather than guessed at.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigurationError(f"{where} must be True or False, got {value!r}" + _bool_hint(value))


_TRUE_WORDS = frozenset({"true", "yes", "y", "on", "1", "t"})
_FALSE_WORDS = frozenset({"false", "no", "n", "off", "0", "f", "none", ""})


def _bool_hint(value: Any) -> str:
    """``"; did you mean True?"`` for a string that reads as a bool (an environment variable)."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return "; did you mean True?"
        if word in _FALSE_WORDS:
            return "; did you mean False?"
    return ""


def validate_key_prefix(value: Any, where: str) -> str:
    """Return ``value`` if it is a non-empty str without braces, else raise.

    Braces would make a Redis Cluster hash tag of the prefix, and the keys
    kept beside a lock (fence, hand-off) could land in another slot.
    """
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{where} must be a non-empty str, got {value!r}")
    if "{" in value or "}" in value:
        raise ConfigurationError(f"{where} must not contain braces, got {value!r}")
    return value


def validate_redis_options(value: Any, where: str) -> dict[str, Any]:
    """Return a copy of ``value`` if it is a mapping (of redis-py options), else raise."""
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{where} must be a dict, got {value!r}")
    try:
        check_options(value)
    except ValueError as exc:
        raise ConfigurationError(f"{where}: {exc}") from None
    return dict(value)


def validate_url(value: Any, where: str) -> str | None:
    """Return ``value`` if it is a URL that names a Redis server (or None), else raise.

    The URL is parsed as the client will parse it, without connecting: a
    scheme that no Redis client speaks (``http://``), a port or database
    that is not a number, or a Sentinel URL without its service is a
    configuration error, found when the settings are read (before a worker
    is ``ready``), not at the first lock operation. An unreachable server
    is not: it may come up later. ``None`` means "use the broker URL" (see
    :func:`~celery_redislock.settings.app_settings`). The message never
    shows a password.
    """
    if value is None:
        return None
    if not isinstance(value, str) or "://" not in value:
        shown = value
        if isinstance(value, str) and "@" in value:
            # No scheme, so no reading of it is safe: keep only what follows the "@".
            shown = f"**@{value.rpartition('@')[2]}"
        raise ConfigurationError(f"{where} must be a redis:// URL, got {shown!r}")
    scheme = value.partition("://")[0]
    if scheme not in URL_SCHEMES:
        guess = get_close_matches(scheme.lower(), URL_SCHEMES, n=1, cutoff=0.6)
        raise ConfigurationError(
            f"{where} {mask_url(value)!r} cannot name a Redis server: use redis://, "
            "rediss:// (TLS), unix://, sentinel:// or redis+cluster://"
            + (f"; did you mean '{guess[0]}://'?" if guess else "")
        )
    try:
        check_url(value)
    except ValueError as exc:
        raise ConfigurationError(
            f"{where} {mask_url(value)!r} is not a valid Redis URL: {url_error_detail(value, exc)}"
        ) from None  # the cause may quote the password
    return value


def validate_store_class(value: Any, where: str) -> type[LockStore]:
    """A :class:`LockStore` subclass, or its ``"module:Class"`` path (None: LockStore)."""
    if value is None:
        return LockStore
    found = value
    if isinstance(value, str):
        try:
            found = symbol_by_name(value)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigurationError(f"{where} {value!r} cannot be imported: {exc}") from exc
    if not (isinstance(found, type) and issubclass(found, LockStore)):
        raise ConfigurationError(f"{where} must be a subclass of LockStore, got {value!r}")
    return found


def validate_policy(value: Any, where: str) -> ContentionPolicy:
    """Return the policy ``value`` names (or is), else raise."""
    return resolve_policy(value, where)


def validate_lock_args(signature: inspect.Signature, lock_args: Iterable[str], task: str) -> None:
    """Check that every name in ``lock_args`` is a parameter of ``signature``.

    Raises:
        ConfigurationError: a name is unknown, or ``lock_args`` is a bare string.
    """
    if isinstance(lock_args, str):
        raise ConfigurationError(
            f"{task}: lock_args must be a sequence of parameter names, not the string "
            f"{lock_args!r} (write lock_args=({lock_args!r},))"
        )
    unknown = [name for name in lock_args if name not in signature.parameters]
    if unknown:
        known = ", ".join(signature.parameters) or "no parameters"
        raise ConfigurationError(
            f"{task}: lock_args names {', '.join(map(repr, unknown))}, which the task's run() "
            f"does not accept (it takes: {known})"
        )
