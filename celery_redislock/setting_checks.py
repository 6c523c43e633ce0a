"""The checks of what a user set: every app setting at once, and a task's options.

Every setting is checked when an app's settings are first read (a worker
does it at start, see startup.py; a producer at its first ``delay()``), all
at once; a task's ``lock_*`` options when its class is made. Unknown names
get the closest known one ("did you mean ...?").
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from difflib import get_close_matches
from typing import Any

from celery_redislock.exceptions import ConfigurationError
from celery_redislock.setting_specs import SETTINGS, TASK_OPTIONS
from celery_redislock.validators import (
    check_debounce_combination,
    check_limit_combination,
    check_unused_options,
    debounce_wait_error,
    unknown_option_errors,
    validate_enqueue_mode,
)

__all__ = [
    "check_merged_task_options",
    "raise_for",
    "resolve_settings",
    "validate_app_settings",
    "validate_task_options",
]


_SETTING_PREFIX = "redislock_"


def _spellings(name: str, prefix: str | None) -> tuple[str, ...]:
    """The spellings Celery reads for ``name`` (see ``ConfigurationView._to_keys``)."""
    if not prefix:
        return (name,)
    namespaced = prefix + name
    return (namespaced.upper() if prefix.isupper() else namespaced, name)


def _closest_setting(bare: str) -> str | None:
    """The known setting closest to ``bare`` (a lowercase ``redislock_*`` name), if any."""
    # Compared without the common "redislock_", which would make every name look close.
    suffixes = {spec.name[len(_SETTING_PREFIX) :]: spec.name for spec in SETTINGS}
    guesses = get_close_matches(bare[len(_SETTING_PREFIX) :], list(suffixes), n=1, cutoff=0.6)
    return suffixes[guesses[0]] if guesses else None


def _unknown_setting_errors(conf: Any) -> list[str]:
    """Messages for ``redislock_*`` keys in ``conf`` that nothing reads, with a did-you-mean."""
    prefix = getattr(conf, "prefix", None) or None
    readable = {spelling for spec in SETTINGS for spelling in _spellings(spec.name, prefix)}
    errors = []
    for key in sorted({key for key in conf if isinstance(key, str)}):
        lowered, unread_namespace = key.lower(), False
        if prefix and lowered.startswith(prefix.lower()):
            bare = lowered[len(prefix) :]
        elif not prefix and lowered.startswith(f"celery_{_SETTING_PREFIX}"):
            # CELERY_REDISLOCK_TTL in a settings module loaded without the namespace.
            bare, unread_namespace = lowered[len("celery_") :], True
        else:
            bare = lowered
        if not bare.startswith(_SETTING_PREFIX) or key in readable:
            continue
        if unread_namespace:
            problem = "is not read: the app's config was loaded without namespace='CELERY'"
        else:
            problem = "is not a celery-redislock setting"
        guess = _closest_setting(bare)
        if guess is None:
            errors.append(f"{key} {problem} (none has a similar name)")
            continue
        # Suggest the spelling in the style the user wrote (namespaced or not).
        namespaced = prefix is not None and (key.isupper() or lowered.startswith(prefix.lower()))
        suggestion = _spellings(guess, prefix)[0] if namespaced else guess
        errors.append(f"{key} {problem}; did you mean {suggestion}?")
    return errors


def resolve_settings(conf: Any) -> tuple[dict[str, Any], list[str]]:
    """Validate every setting in ``conf``: the usable values and the messages for the rest."""
    values: dict[str, Any] = {}
    errors = _unknown_setting_errors(conf)
    prefix = getattr(conf, "prefix", None) or None
    present = {key for key in conf if isinstance(key, str)}
    for spec in SETTINGS:
        raw = conf.get(spec.name)
        # Name the setting as it was spelled (CELERY_REDISLOCK_TTL under a namespace).
        where = next((key for key in _spellings(spec.name, prefix) if key in present), spec.name)
        try:
            values[spec.name] = spec.validate(spec.default if raw is None else raw, where)
        except ConfigurationError as exc:
            errors.append(str(exc))
    errors += _combination_errors(values)
    if "redislock_url" in values and values["redislock_url"] is None:
        broker = conf.get("broker_url")
        if not (isinstance(broker, str) and broker.startswith(("redis://", "rediss://"))):
            errors.append(
                "redislock_url is not set (app.conf.redislock_url = 'redis://host:6379/1', "
                "or CELERY_REDISLOCK_URL with the CELERY namespace) and the broker is not Redis"
            )
    return values, errors


def _combination_errors(values: Mapping[str, Any]) -> list[str]:
    """Messages for app settings that are each usable but not together."""
    ttl, renew_timeout = values.get("redislock_ttl"), values.get("redislock_renew_timeout")
    errors = [
        renewal_error(("redislock_ttl", ttl), renew_timeout)
        if ttl is not None and renew_timeout is not None
        else None,
        debounce_wait_error(
            ("redislock_debounce", values.get("redislock_debounce") or 0.0),
            ("redislock_debounce_max_wait", values.get("redislock_debounce_max_wait")),
        ),
    ]
    return [error for error in errors if error]


def renewal_error(ttl: tuple[str, float], renew_timeout: float) -> str | None:
    """The message for a lock TTL (named ``ttl[0]``) not longer than the renewals' timeout."""
    name, seconds = ttl
    if renew_timeout < seconds:
        return None
    return (
        f"redislock_renew_timeout={renew_timeout:g} is not shorter than {name}={seconds:g}: "
        "one renewal round waiting that long lets the locks expire; keep it well under "
        "the TTL (default 0.5 s)"
    )


def raise_for(errors: list[str]) -> None:
    """Raise one :class:`ConfigurationError` naming every message of ``errors``, if any."""
    if len(errors) == 1:
        raise ConfigurationError(errors[0])
    if errors:
        listed = "".join(f"\n  - {error}" for error in errors)
        raise ConfigurationError(f"{len(errors)} celery-redislock settings are wrong:{listed}")


def validate_app_settings(conf: Any) -> None:
    """Check every ``redislock_*`` setting of ``conf`` (an ``app.conf``).

    Unknown ``redislock_*`` names (``CELERY_REDISLOCK_*`` under a
    namespace) are reported with the closest known name.

    Raises:
        ConfigurationError: naming every bad setting at once, with the reason.
    """
    conf.get("broker_url")  # loads a pending configuration (and its namespace)
    raise_for(resolve_settings(conf)[1])


def validate_task_options(cls: type, where: str, base: type | None = None) -> None:
    """Check a task class's ``lock_*`` options when the class is made, not when it runs.

    Args:
        cls: The task class.
        where: ``"task <name>"``, the start of every message.
        base: The package's task class (``SingletonTaskMixin``). Each
            ``lock_*`` name set by ``cls`` or a class between it and
            ``base`` must be an option or one of ``base``'s helpers
            (``lock_key_for``), which a task may override. A ``lock_*`` name
            of another base is that base's business; ``@app.task(lock_tll=10)``
            puts its options on the class Celery makes.

    Raises:
        ConfigurationError: a ``lock_*`` name is not an option (with the
            closest option), an option has a bad value (every one of those
            at once), or two options are set that do not go together.
    """
    unknown = {}
    if base is not None:
        helpers = {name for name in vars(base) if name.startswith("lock_")} - set(TASK_OPTIONS)
        unknown = {
            name: value
            for klass in reversed(cls.__mro__)
            if issubclass(klass, base) and klass is not base
            for name, value in vars(klass).items()
            if name not in helpers and _reserved(name)
        }
    errors = unknown_option_errors(unknown, TASK_OPTIONS)
    for spec in SETTINGS:
        if spec.task_attribute is None:
            continue
        value = getattr(cls, spec.task_attribute, None)
        if value is not None:
            try:
                spec.validate(value, spec.task_attribute)
            except ConfigurationError as exc:
                errors.append(str(exc))
    if len(errors) == 1:
        raise ConfigurationError(f"{where}: {errors[0]}")
    if errors:
        listed = "".join(f"\n  - {error}" for error in errors)
        raise ConfigurationError(f"{len(errors)} options of {where} are wrong:{listed}")
    check_debounce_combination(
        getattr(cls, "lock_debounce", None) or 0, bool(getattr(cls, "lock_enqueue", None)), where
    )
    check_limit_combination(
        getattr(cls, "lock_limit", None) or 1,
        validate_enqueue_mode(getattr(cls, "lock_enqueue", None), where) == "until_done",
        getattr(cls, "lock_hold_after_success", None) or 0,
        where,
    )
    too_short = debounce_wait_error(
        ("lock_debounce", getattr(cls, "lock_debounce", None) or 0.0),
        ("lock_debounce_max_wait", getattr(cls, "lock_debounce_max_wait", None)),
    )
    if too_short:
        raise ConfigurationError(f"{where}: {too_short}")
    key_function = getattr(cls, "lock_key", None)
    if key_function is not None and not callable(key_function):
        raise ConfigurationError(f"{where}: lock_key must be callable, got {key_function!r}")
    if key_function is not None:
        _check_key_function(key_function, where)
    if key_function is not None and getattr(cls, "lock_args", None) is not None:
        raise ConfigurationError(f"{where}: set lock_args or lock_key, not both")


def _reserved(name: str) -> bool:
    """A ``lock_*`` name, or one so close to an option that it is a typo (``locks_args``)."""
    if name.startswith("lock_"):
        return True
    return name.startswith("lock") and bool(get_close_matches(name, TASK_OPTIONS, 1, 0.85))


def _check_key_function(key_function: Any, where: str) -> None:
    """Refuse a ``lock_key`` that cannot be called as ``lock_key(args, kwargs)``.

    Raises:
        ConfigurationError: it takes other arguments (found at the class
            statement, not at every ``delay()`` and run as a ``TypeError``).
    """
    try:
        # Not followed to a function it wraps: an adapter made with
        # functools.wraps takes (args, kwargs) whatever the adapted one takes.
        signature = inspect.signature(key_function, follow_wrapped=False)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return
    try:
        signature.bind((), {})
    except TypeError as exc:
        raise ConfigurationError(
            f"{where}: lock_key{signature} cannot be called as lock_key(args, kwargs): {exc}"
        ) from None


def check_merged_task_options(
    task: Any, debounce: float, max_wait: float | None, enqueue: bool, where: str
) -> None:
    """Refuse what a task's options mean only beside the app's settings.

    Raises:
        ConfigurationError: a task option without effect, or a debounce cap
            shorter than its window, each naming where its values came from.
    """
    # Set on the task's own class: one a shared base class sets is a
    # default, as an app-wide setting is (review helper-45 F4).
    defined = vars(type(task))
    own = {name for name in ("lock_debounce", "lock_debounce_max_wait", "lock_enqueue_raise")
           if defined.get(name) is not None}  # fmt: skip
    check_unused_options(
        {
            name: is_on
            for name, is_on in (
                ("lock_debounce_max_wait", bool(debounce)),
                ("lock_enqueue_raise", enqueue),
            )
            if name in own
        },
        where,
    )
    too_short = debounce_wait_error(
        (("lock_" if "lock_debounce" in own else "redislock_") + "debounce", debounce),
        (
            ("lock_" if "lock_debounce_max_wait" in own else "redislock_") + "debounce_max_wait",
            None if max_wait is None else float(max_wait),
        ),
    )
    if too_short:
        raise ConfigurationError(f"{where}: {too_short}")
