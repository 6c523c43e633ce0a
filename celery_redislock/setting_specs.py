"""The registry of app settings: what each one is, its default, its check.

:data:`SETTINGS` is the one list of app settings (name, task attribute,
default, doc, validator; the validators are in validators.py): the readers
(settings.py), the checks of what a user set (setting_checks.py) and the
docs all come from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery_redislock.validators import (
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

__all__ = ["DEFAULTS", "SETTINGS", "SETTINGS_BY_NAME", "TASK_OPTIONS", "SettingSpec"]


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
        "timeouts, 2 quick client retries. A name redis-py does not take (here or in the "
        "URL's query) and a timeout that is not a number are refused when settings are read.",
        validate_redis_options,
    ),
    SettingSpec(
        "redislock_renew_timeout",
        None,
        0.5,
        "Socket timeout of the renewer's own connection (it never retries inside redis-py); "
        "shorter than `redislock_ttl` (refused otherwise) and every task's `lock_ttl` "
        "(logged at WARNING otherwise, at the task's first use).",
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
        "still runs; at least the window.",
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

#: Every task option: the settings' task attributes, and the two that make the key.
TASK_OPTIONS: tuple[str, ...] = (
    "lock_args",
    "lock_key",
    *(spec.task_attribute for spec in SETTINGS if spec.task_attribute is not None),
)
