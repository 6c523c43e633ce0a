"""Settings, read in one place: task attribute, else app setting, else default.

:data:`SETTINGS` is the one list of app settings (name, task attribute,
default, doc, validator; the validators are in validators.py): the
readers, :func:`validate_app_settings`, the task-option checks and the docs
all come from it. Every setting is checked
when an app's settings are first read (a worker does it at start, see
startup.py; a producer at its first ``delay()``), all at once.

App settings are read lazily with ``app.conf.get(...)`` the first time a lock
is used, never registered with ``app.add_defaults`` (which would shadow a
value loaded by ``config_from_object``). Under
``config_from_object(..., namespace="CELERY")`` the ``CELERY_REDISLOCK_*``
spelling works too. Each app gets its own settings and its own Redis
clients, so two apps in one process can use two lock stores.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field
from difflib import get_close_matches
from typing import TYPE_CHECKING, Any

from celery_redislock.clients import bounded_options
from celery_redislock.exceptions import ConfigurationError
from celery_redislock.handoff import publisher as handoff_publisher
from celery_redislock.policies import ContentionPolicy, resolve_policy
from celery_redislock.store import LockStore
from celery_redislock.validators import (
    check_limit_combination,
    unknown_option_errors,
    validate_backend_error_mode,
    validate_count,
    validate_debounce,
    validate_enqueue_mode,
    validate_flag,
    validate_hold,
    validate_key_prefix,
    validate_limit,
    validate_lost_mode,
    validate_max_wait,
    validate_policy,
    validate_redis_options,
    validate_store_class,
    validate_ttl,
    validate_url,
)

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "DEFAULTS",
    "SETTINGS",
    "SETTINGS_BY_NAME",
    "TASK_OPTIONS",
    "AppSettings",
    "SettingSpec",
    "TaskSettings",
    "app_settings",
    "validate_app_settings",
    "validate_backend_error_mode",
    "validate_count",
    "validate_debounce",
    "validate_enqueue_mode",
    "validate_hold",
    "validate_limit",
    "validate_lost_mode",
    "validate_ttl",
]

# The documented logger name (the module was config.py).
logger = logging.getLogger("celery_redislock.config")


@dataclass(frozen=True)
class SettingSpec:
    """One ``redislock_*`` app setting: the single source for readers, validation and docs.

    Attributes:
        name: The app setting, e.g. ``"redislock_ttl"`` (``CELERY_REDISLOCK_TTL``
            under ``config_from_object(..., namespace="CELERY")``).
        task_attribute: The task class attribute that overrides it
            (``"lock_ttl"``), or None when it is app-wide only.
        default: The library default, used when the setting is unset or None.
        doc: One short markdown paragraph: what the setting means.
        validate: ``validate(value, where)`` returns the value to use or
            raises :class:`ConfigurationError` naming ``where``.
        default_doc: How the default reads in the docs (markdown), when the
            value alone would mislead.
    """

    name: str
    task_attribute: str | None
    default: object
    doc: str
    validate: Callable[[Any, str], Any]
    default_doc: str | None = None

    @property
    def shown_default(self) -> str:
        """The default as the docs show it (markdown)."""
        if self.default_doc is not None:
            return self.default_doc
        return f"`{self.default!r}`" if isinstance(self.default, str) else f"`{self.default}`"


#: Every app setting the package reads, in the order the docs list them.
SETTINGS: tuple[SettingSpec, ...] = (
    SettingSpec(
        "redislock_url",
        None,
        None,
        "Redis holding the locks: `redis://`, `rediss://` (TLS), `unix://`, "
        "`sentinel://host:port[,host:port]/service[/db]` or `redis+cluster://host:port`.",
        validate_url,
        default_doc="broker URL if it is Redis (with a warning), else required",
    ),
    SettingSpec(
        "redislock_key_prefix",
        None,
        "redislock",
        "First part of every key.",
        validate_key_prefix,
    ),
    SettingSpec(
        "redislock_ttl",
        "lock_ttl",
        30.0,
        "Lock time to live, seconds. Renewed every TTL/3 while the holder lives, so keep it "
        "short: it bounds how long a lock survives a dead worker.",
        validate_ttl,
        default_doc="`30`",
    ),
    SettingSpec(
        "redislock_on_contention",
        "lock_on_contention",
        "skip",
        '`"skip"`, `"retry"`, `"raise"`, `"wait"`, `"handoff"` or a policy object.',
        validate_policy,
    ),
    SettingSpec(
        "redislock_on_backend_error",
        "lock_on_backend_error",
        "fail",
        'Redis unreachable at acquire: `"fail"` = do not run unprotected, retry the task '
        'with backoff; `"run"` = run without the lock, logged at WARNING.',
        validate_backend_error_mode,
    ),
    SettingSpec(
        "redislock_backend_error_max_retries",
        None,
        10,
        'Backoff retries (1, 2, 4 … 60 s, jittered) before `"fail"` gives up with '
        "`LockBackendError` (state FAILURE).",
        validate_count,
    ),
    SettingSpec(
        "redislock_redis_options",
        None,
        {},
        "Extra `redis.Redis.from_url` options. Package defaults: 5 s socket and connect "
        "timeouts, 2 quick client retries.",
        validate_redis_options,
    ),
    SettingSpec(
        "redislock_renew_timeout",
        None,
        0.5,
        "Socket timeout of the renewer's own connection (it never retries inside redis-py).",
        validate_ttl,
    ),
    SettingSpec(
        "redislock_enabled",
        "lock_enabled",
        True,
        "`False` turns locking off.",
        validate_flag,
    ),
    SettingSpec(
        "redislock_on_lost",
        "lock_on_lost",
        "report",
        '`"abort"` also raises `LockLost` in the running body when the lock is lost.',
        validate_lost_mode,
    ),
    SettingSpec(
        "redislock_fence_ttl",
        None,
        0.0,
        "Seconds (at least) a key's fence counter is kept after its lock is released (or expires). "
        "At `0` the counter goes with the lock (unless it is still ahead of the server "
        "clock: then until the clock passes it), so a released key leaves nothing behind; "
        "the next fence comes from the server clock, still larger. A positive value keeps "
        "fences increasing for that long even if the server clock steps back (a failover "
        "to a replica with a slower clock), at one resident key per recently used key.",
        validate_hold,
        default_doc="`0` (released with the lock)",
    ),
    SettingSpec(
        "redislock_store_class",
        None,
        None,
        'A `celery_redislock.store.LockStore` subclass (or its `"module:Class"` path) whose '
        "`do_acquire`/`do_release`/`do_extend`/`do_renew` you override, e.g. to instrument "
        "the scripts.",
        validate_store_class,
        default_doc="`LockStore`",
    ),
    SettingSpec(
        "redislock_enqueue",
        "lock_enqueue",
        False,
        'Also lock at `apply_async`/`delay`, before publishing. `True` (or `"until_done"`) '
        'holds the key until the run ends; `"until_start"` only until it starts: '
        "coalescing, one running and at most one queued.",
        validate_enqueue_mode,
    ),
    SettingSpec(
        "redislock_enqueue_ttl",
        "lock_enqueue_ttl",
        600.0,
        "Seconds a queued, not yet started task holds its key; a countdown/ETA is added.",
        validate_ttl,
        default_doc="`600`",
    ),
    SettingSpec(
        "redislock_enqueue_raise",
        "lock_enqueue_raise",
        False,
        "A duplicate `delay()` raises `AlreadyQueued` instead of returning the holder's "
        "`AsyncResult`.",
        validate_flag,
    ),
    SettingSpec(
        "redislock_enqueue_timeout",
        None,
        1.0,
        "Longest wait, seconds, of `delay()`/`apply_async` on the lock store for a "
        "`lock_enqueue` or debounced task (connecting and the reply get half each, no "
        "retry). After it the call is published without its enqueue lock or debounce, "
        "never dropped; the run-time lock still keeps runs apart.",
        validate_ttl,
        default_doc="`1`",
    ),
    SettingSpec(
        "redislock_debounce",
        "lock_debounce",
        0.0,
        "Trailing debounce window, seconds: a burst of calls for one key gives one run, "
        "started this long after the burst's last call. Not with `lock_enqueue`.",
        validate_debounce,
        default_doc="`0` (off)",
    ),
    SettingSpec(
        "redislock_debounce_max_wait",
        "lock_debounce_max_wait",
        None,
        "Longest delay from a burst's first call to its run, so a burst that never ends "
        "still runs.",
        validate_max_wait,
        default_doc="ten windows",
    ),
    SettingSpec(
        "redislock_limit",
        "lock_limit",
        1,
        "At most this many executions per key at once (a counting semaphore of N "
        "token-owned slots). Not with `lock_enqueue=True` or `lock_hold_after_success`.",
        validate_limit,
    ),
    SettingSpec(
        "redislock_hold_after_success",
        "lock_hold_after_success",
        0.0,
        "Keep the key this many seconds after a successful run: an idempotency window for "
        "late duplicates.",
        validate_hold,
        default_doc="`0` (off)",
    ),
    SettingSpec(
        "redislock_beat_on_contention",
        "lock_beat_on_contention",
        "skip",
        "Policy for runs sent by celery beat (header `celery_beat_task`).",
        validate_policy,
    ),
    SettingSpec(
        "redislock_min_replicas",
        "lock_min_replicas",
        0,
        "After taking the lock, `WAIT` on the same connection until this many replicas have "
        "it; if fewer acknowledge in time, release it and treat it as a lock-store error "
        "(`on_backend_error`). Not with Redis Cluster.",
        validate_count,
        default_doc="`0` (off)",
    ),
    SettingSpec(
        "redislock_min_replicas_timeout",
        "lock_min_replicas_timeout",
        1.0,
        "Longest `WAIT` for those replicas, seconds.",
        validate_ttl,
    ),
    SettingSpec(
        "redislock_recover_on_start",
        None,
        True,
        "When a worker starts, release the locks its previous run left behind: values "
        "naming this worker's node name and a process that no longer runs on this host, "
        "taken before this worker started. Needs node names unique and stable across "
        "restarts (`-n name@%h`).",
        validate_flag,
    ),
    SettingSpec(
        "redislock_sweep_interval",
        None,
        1.0,
        "Seconds between a worker's sweeps of the pending calls (parked, coalesced and "
        "debounced calls whose worker died, re-sends the broker refused): one `EVALSHA` "
        "per worker per sweep when nothing is due. `0` turns sweeping off in this worker.",
        validate_hold,
    ),
)

#: The registry by app setting name.
SETTINGS_BY_NAME: Mapping[str, SettingSpec] = {spec.name: spec for spec in SETTINGS}

#: Library defaults, by app setting name (from :data:`SETTINGS`).
DEFAULTS: Mapping[str, Any] = {spec.name: spec.default for spec in SETTINGS}

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


def _resolve(conf: Any) -> tuple[dict[str, Any], list[str]]:
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
    if "redislock_url" in values and values["redislock_url"] is None:
        broker = conf.get("broker_url")
        if not (isinstance(broker, str) and broker.startswith(("redis://", "rediss://"))):
            errors.append(
                "redislock_url is not set (app.conf.redislock_url = 'redis://host:6379/1', "
                "or CELERY_REDISLOCK_URL with the CELERY namespace) and the broker is not Redis"
            )
    return values, errors


def _raise_for(errors: list[str]) -> None:
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
    _raise_for(_resolve(conf)[1])


@dataclass(frozen=True)
class AppSettings:
    """The resolved ``redislock_*`` settings of one app."""

    url: str
    key_prefix: str
    ttl: float
    on_contention: ContentionPolicy
    on_backend_error: str
    redis_options: Mapping[str, Any]
    enabled: bool
    renew_timeout: float
    backend_error_max_retries: int
    enqueue: str
    enqueue_ttl: float
    enqueue_raise: bool
    debounce: float
    debounce_max_wait: float | None
    hold_after_success: float
    beat_on_contention: ContentionPolicy
    on_lost: str
    min_replicas: int
    min_replicas_timeout: float
    backend: LockStore = field(compare=False, repr=False)
    limit: int = 1
    recover_on_start: bool = True
    sweep_interval: float = 1.0
    enqueue_timeout: float = 1.0
    #: The producer's store: the same server, its calls bounded by
    #: ``enqueue_timeout`` (None: ``backend``).
    enqueue_backend: LockStore | None = field(default=None, compare=False, repr=False)


_CACHE: weakref.WeakKeyDictionary[Celery, AppSettings] = weakref.WeakKeyDictionary()
_CACHE_GUARD = threading.Lock()


def _new_cache_guard() -> None:
    global _CACHE_GUARD
    _CACHE_GUARD = threading.Lock()  # it may have been held by another thread at the fork


os.register_at_fork(after_in_child=_new_cache_guard)


def _read(app: Celery) -> AppSettings:
    app.conf.get("broker_url")  # loads a pending configuration (and its namespace)
    values, errors = _resolve(app.conf)
    _raise_for(errors)
    url = values["redislock_url"]
    if url is None:
        url = app.conf.get("broker_url")
        logger.warning(
            "redislock_url is not set; using the broker URL for locks. "
            "Set redislock_url explicitly to silence this warning."
        )
    options = values["redislock_redis_options"]
    renew_timeout = values["redislock_renew_timeout"]
    return AppSettings(
        url=url,
        key_prefix=values["redislock_key_prefix"],
        ttl=values["redislock_ttl"],
        on_contention=values["redislock_on_contention"],
        on_backend_error=values["redislock_on_backend_error"],
        redis_options=dict(options),
        enabled=values["redislock_enabled"],
        renew_timeout=renew_timeout,
        backend_error_max_retries=values["redislock_backend_error_max_retries"],
        enqueue=values["redislock_enqueue"],
        enqueue_ttl=values["redislock_enqueue_ttl"],
        enqueue_raise=values["redislock_enqueue_raise"],
        debounce=values["redislock_debounce"],
        debounce_max_wait=values["redislock_debounce_max_wait"],
        hold_after_success=values["redislock_hold_after_success"],
        beat_on_contention=values["redislock_beat_on_contention"],
        on_lost=values["redislock_on_lost"],
        min_replicas=values["redislock_min_replicas"],
        min_replicas_timeout=values["redislock_min_replicas_timeout"],
        limit=values["redislock_limit"],
        recover_on_start=values["redislock_recover_on_start"],
        sweep_interval=values["redislock_sweep_interval"],
        backend=values["redislock_store_class"](
            url,
            dict(options),
            renew_timeout=renew_timeout,
            fence_ttl=values["redislock_fence_ttl"],
        ),
        enqueue_timeout=values["redislock_enqueue_timeout"],
        # Connections of its own: a web request's delay() must not wait out
        # the commands' 5 s timeouts and retries (15 s against a frozen store).
        enqueue_backend=values["redislock_store_class"](
            url,
            bounded_options(options, values["redislock_enqueue_timeout"]),
            renew_timeout=renew_timeout,
            fence_ttl=values["redislock_fence_ttl"],
        ),
    )


def _install_handoff(app: Celery, settings: AppSettings) -> AppSettings:
    """Let releases through this app's store publish the messages of parked executions."""
    settings.backend.on_handoff = handoff_publisher(app)
    settings.backend.handoff_ttl_ms = max(int(settings.ttl * 1000), 1)
    return settings


def app_settings(app: Celery) -> AppSettings:
    """Return ``app``'s lock settings, reading them on first use.

    Raises:
        ConfigurationError: a setting has an unusable value.
    """
    settings = _CACHE.get(app)
    if settings is None:
        with _CACHE_GUARD:
            settings = _CACHE.get(app)
            if settings is None:
                settings = _install_handoff(app, _read(app))
                _CACHE[app] = settings
    return settings


def forget_app_settings(app: Celery) -> None:
    """Drop ``app``'s cached settings, so the next use reads them again."""
    with _CACHE_GUARD:
        settings = _CACHE.pop(app, None)
    if settings is not None:
        settings.backend.close()
        if settings.enqueue_backend is not None:
            settings.enqueue_backend.close()


@dataclass(frozen=True)
class TaskSettings:
    """One task's effective settings: its ``lock_*`` attributes over the app's."""

    app: AppSettings
    backend: LockStore
    enabled: bool
    ttl: float
    ttl_ms: int
    policy: ContentionPolicy
    beat_policy: ContentionPolicy
    on_backend_error: str
    enqueue: bool
    coalesce: bool
    enqueue_ttl: float
    enqueue_raise: bool
    debounce: float
    debounce_max_wait: float
    hold_after_success: float
    on_lost: str
    min_replicas: int
    min_replicas_timeout: float
    limit: int = 1
    #: The store of the producer's calls (``delay()``), bounded by ``redislock_enqueue_timeout``.
    enqueue_backend: LockStore | None = field(default=None, compare=False, repr=False)

    @classmethod
    def merge(cls, task: Any, app: AppSettings) -> TaskSettings:
        """Merge ``task``'s non-None ``lock_*`` attributes over ``app``."""

        def pick(attribute: str, default: Any) -> Any:
            value = getattr(task, attribute, None)
            return default if value is None else value

        ttl = float(pick("lock_ttl", app.ttl))
        enqueue = validate_enqueue_mode(pick("lock_enqueue", app.enqueue), "lock_enqueue")
        debounce = float(pick("lock_debounce", app.debounce))
        max_wait = pick("lock_debounce_max_wait", app.debounce_max_wait)
        limit = int(pick("lock_limit", app.limit))
        hold = float(pick("lock_hold_after_success", app.hold_after_success))
        check_limit_combination(
            limit, enqueue == "until_done", hold, f"task {getattr(task, 'name', task)}"
        )
        return cls(
            app=app,
            backend=app.backend,
            enqueue_backend=app.enqueue_backend or app.backend,
            enabled=bool(pick("lock_enabled", app.enabled)),
            ttl=ttl,
            ttl_ms=max(int(ttl * 1000), 1),
            policy=resolve_policy(pick("lock_on_contention", app.on_contention)),
            beat_policy=resolve_policy(pick("lock_beat_on_contention", app.beat_on_contention)),
            on_backend_error=str(pick("lock_on_backend_error", app.on_backend_error)),
            enqueue=enqueue != "off",
            coalesce=enqueue == "until_start",
            enqueue_ttl=float(pick("lock_enqueue_ttl", app.enqueue_ttl)),
            enqueue_raise=bool(pick("lock_enqueue_raise", app.enqueue_raise)),
            debounce=debounce,
            # A burst that never ends still runs: by default after ten windows.
            debounce_max_wait=float(max_wait) if max_wait is not None else 10 * debounce,
            hold_after_success=hold,
            on_lost=str(pick("lock_on_lost", app.on_lost)),
            min_replicas=int(pick("lock_min_replicas", app.min_replicas)),
            min_replicas_timeout=float(pick("lock_min_replicas_timeout", app.min_replicas_timeout)),
            limit=limit,
        )


#: Every task option: the settings' task attributes, and the two that make the key.
TASK_OPTIONS: tuple[str, ...] = (
    "lock_args",
    "lock_key",
    *(spec.task_attribute for spec in SETTINGS if spec.task_attribute is not None),
)


def validate_task_options(
    cls: type, where: str, defined: Mapping[str, Any] | None = None, helpers: Set[str] = frozenset()
) -> None:
    """Check a task class's ``lock_*`` options when the class is made, not when it runs.

    Args:
        cls: The task class.
        where: ``"task <name>"``, the start of every message.
        defined: The ``lock_*`` names the task's own classes define, with
            their values: each must be an option (or one of ``helpers``).
        helpers: ``lock_*`` names of the package's task classes that are not
            options (``lock_key_for``), which a task may override.

    Raises:
        ConfigurationError: a ``lock_*`` name is not an option (with the
            closest option), an option has a bad value (every one of those
            at once), or two options are set that do not go together.
    """
    unknown = {name: value for name, value in (defined or {}).items() if name not in helpers}
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
    if getattr(cls, "lock_debounce", None) and getattr(cls, "lock_enqueue", None):
        raise ConfigurationError(
            f"{where}: set lock_debounce or lock_enqueue, not both (a debounced call "
            "already joins the burst's run)"
        )
    check_limit_combination(
        getattr(cls, "lock_limit", None) or 1,
        validate_enqueue_mode(getattr(cls, "lock_enqueue", None), where) == "until_done",
        getattr(cls, "lock_hold_after_success", None) or 0,
        where,
    )
    key_function = getattr(cls, "lock_key", None)
    if key_function is not None and not callable(key_function):
        raise ConfigurationError(f"{where}: lock_key must be callable, got {key_function!r}")
    if key_function is not None and getattr(cls, "lock_args", None) is not None:
        raise ConfigurationError(f"{where}: set lock_args or lock_key, not both")
