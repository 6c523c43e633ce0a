"""Settings, read in one place: task attribute, else app setting, else default.

Which settings exist is the registry's (``setting_specs.py``), how what a
user set is checked ``setting_checks.py``'s (both re-exported here); this
module reads them.

App settings are read lazily with ``app.conf.get(...)`` the first time a lock
is used, never registered with ``app.add_defaults`` (which would shadow a
value loaded by ``config_from_object``). Under
``config_from_object(..., namespace="CELERY")`` the ``CELERY_REDISLOCK_*``
spelling works too. Each app gets its own settings and its own Redis
clients, so two apps in one process can use two lock stores.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery_redislock.clients import bounded_options
from celery_redislock.handoff import parked_looker
from celery_redislock.handoff import publisher as handoff_publisher
from celery_redislock.policies import ContentionPolicy, resolve_policy, uses_handoff
from celery_redislock.setting_checks import (
    check_merged_task_options,
    raise_for,
    renewal_error,
    resolve_settings,
    validate_app_settings,
    validate_task_options,
)
from celery_redislock.setting_specs import (
    DEFAULTS,
    SETTINGS,
    SETTINGS_BY_NAME,
    TASK_OPTIONS,
    SettingSpec,
)
from celery_redislock.store import LockStore
from celery_redislock.validators import (
    MAX_SECONDS,
    check_debounce_combination,
    check_limit_combination,
    validate_backend_error_mode,
    validate_count,
    validate_debounce,
    validate_enqueue_mode,
    validate_hold,
    validate_limit,
    validate_lost_mode,
    validate_ttl,
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
    "validate_task_options",
    "validate_ttl",
]

# The documented logger name (the module was config.py).
logger = logging.getLogger("celery_redislock.config")


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
    values, errors = resolve_settings(app.conf)
    raise_for(errors)
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
    settings.backend.on_handoff = handoff_publisher(
        app, settings.backend, settings.key_prefix, swept=settings.sweep_interval > 0
    )
    settings.backend.on_kept_waited = parked_looker(app, settings.backend, settings.key_prefix)
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

    @functools.cached_property
    def hands_off(self) -> bool:
        """The contention policy parks calls (``HandOff``, or one composed with it)."""
        return uses_handoff(self.policy)

    @functools.cached_property
    def beat_hands_off(self) -> bool:
        """The beat calls' contention policy parks calls."""
        return uses_handoff(self.beat_policy)

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
        where = f"task {getattr(task, 'name', task)}"
        check_limit_combination(limit, enqueue == "until_done", hold, where)
        check_debounce_combination(debounce, enqueue != "off", where)
        check_merged_task_options(task, debounce, max_wait, enqueue != "off", where)
        # The renewer's connections wait this long for a reply. A short TTL
        # still works while Redis answers fast, and a loss is detected: said,
        # not refused as an app-wide TTL is (every lock would be at risk).
        if too_long := renewal_error(("lock_ttl", ttl), app.renew_timeout):
            logger.warning("%s: %s", where, too_long)
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
            debounce_max_wait=(
                float(max_wait) if max_wait is not None else min(10 * debounce, MAX_SECONDS)
            ),
            hold_after_success=hold,
            on_lost=str(pick("lock_on_lost", app.on_lost)),
            min_replicas=int(pick("lock_min_replicas", app.min_replicas)),
            min_replicas_timeout=float(pick("lock_min_replicas_timeout", app.min_replicas_timeout)),
            limit=limit,
        )
