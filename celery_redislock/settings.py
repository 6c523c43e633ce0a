"""Settings, read in one place: task attribute, else app setting, else default.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery.utils.imports import symbol_by_name

from celery_redislock.exceptions import ConfigurationError
from celery_redislock.handoff import publisher as handoff_publisher
from celery_redislock.policies import ContentionPolicy, resolve_policy
from celery_redislock.store import LockStore
from celery_redislock.urls import mask_url

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "DEFAULTS",
    "AppSettings",
    "TaskSettings",
    "app_settings",
    "validate_backend_error_mode",
    "validate_count",
    "validate_debounce",
    "validate_enqueue_mode",
    "validate_hold",
    "validate_lost_mode",
    "validate_ttl",
]

# The documented logger name (the module was config.py).
logger = logging.getLogger("celery_redislock.config")

#: Library defaults, by app setting name.
DEFAULTS: Mapping[str, Any] = {
    "redislock_url": None,
    "redislock_key_prefix": "redislock",
    "redislock_ttl": 30.0,
    "redislock_on_contention": "skip",
    "redislock_on_backend_error": "fail",
    "redislock_redis_options": {},
    "redislock_enabled": True,
    "redislock_renew_timeout": 0.5,
    "redislock_backend_error_max_retries": 10,
    "redislock_enqueue": False,
    "redislock_enqueue_ttl": 600.0,
    "redislock_enqueue_raise": False,
    "redislock_debounce": 0.0,
    "redislock_debounce_max_wait": None,
    "redislock_hold_after_success": 0.0,
    "redislock_beat_on_contention": "skip",
    "redislock_fence_ttl": 3600.0,
    "redislock_store_class": None,
    "redislock_on_lost": "report",
    "redislock_min_replicas": 0,
    "redislock_min_replicas_timeout": 1.0,
}


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
    return float(ttl)


BACKEND_ERROR_MODES = ("fail", "run")


def validate_backend_error_mode(value: Any, where: str) -> str:
    """Return ``value`` if it is ``"fail"`` or ``"run"``, else raise."""
    if value not in BACKEND_ERROR_MODES:
        raise ConfigurationError(f"{where} must be 'fail' or 'run', got {value!r}")
    return str(value)


LOST_MODES = ("report", "abort")


def validate_lost_mode(value: Any, where: str) -> str:
    """Return ``value`` if it is ``"report"`` or ``"abort"``, else raise."""
    if value not in LOST_MODES:
        raise ConfigurationError(f"{where} must be 'report' or 'abort', got {value!r}")
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
    if value is False or value is None:
        return "off"
    if value is True:
        return "until_done"
    if isinstance(value, str) and value in ENQUEUE_MODES:
        return value
    raise ConfigurationError(
        f"{where} must be False, True, 'until_done' or 'until_start', got {value!r}"
    )


def validate_debounce(value: Any, where: str) -> float:
    """Return a debounce window in seconds (0 = off), else raise."""
    return validate_hold(value, where)


def validate_hold(value: Any, where: str) -> float:
    """Return ``value`` as seconds >= 0 (0 turns the window off), else raise."""
    if value == 0:
        return 0.0
    return validate_ttl(value, where)


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


_CACHE: weakref.WeakKeyDictionary[Celery, AppSettings] = weakref.WeakKeyDictionary()
_CACHE_GUARD = threading.Lock()


def _new_cache_guard() -> None:
    global _CACHE_GUARD
    _CACHE_GUARD = threading.Lock()  # it may have been held by another thread at the fork


os.register_at_fork(after_in_child=_new_cache_guard)


def _get(app: Celery, name: str) -> Any:
    value = app.conf.get(name)
    return DEFAULTS[name] if value is None else value


def _resolve_url(app: Celery) -> str:
    url = _get(app, "redislock_url")
    if url is None:
        broker = app.conf.get("broker_url")
        if isinstance(broker, str) and broker.startswith(("redis://", "rediss://")):
            logger.warning(
                "redislock_url is not set; using the broker URL for locks. "
                "Set redislock_url explicitly to silence this warning."
            )
            return broker
        raise ConfigurationError(
            "redislock_url is not set (app.conf.redislock_url = 'redis://host:6379/1', "
            "or CELERY_REDISLOCK_URL with the CELERY namespace) and the broker is not Redis"
        )
    if not isinstance(url, str) or "://" not in url:
        shown = mask_url(url) if isinstance(url, str) else url
        raise ConfigurationError(f"redislock_url must be a redis:// URL, got {shown!r}")
    return url


def _store_class(value: Any) -> type[LockStore]:
    """``redislock_store_class``: a :class:`LockStore` subclass, or its ``"module:Class"`` path."""
    if value is None:
        return LockStore
    found = value
    if isinstance(value, str):
        try:
            found = symbol_by_name(value)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigurationError(
                f"redislock_store_class {value!r} cannot be imported: {exc}"
            ) from exc
    if not (isinstance(found, type) and issubclass(found, LockStore)):
        raise ConfigurationError(
            f"redislock_store_class must be a subclass of LockStore, got {value!r}"
        )
    return found


def _read(app: Celery) -> AppSettings:
    url = _resolve_url(app)
    prefix = _get(app, "redislock_key_prefix")
    if not isinstance(prefix, str) or not prefix:
        raise ConfigurationError(f"redislock_key_prefix must be a non-empty str, got {prefix!r}")
    options = _get(app, "redislock_redis_options")
    if not isinstance(options, Mapping):
        raise ConfigurationError(f"redislock_redis_options must be a dict, got {options!r}")
    max_retries = validate_count(
        _get(app, "redislock_backend_error_max_retries"), "redislock_backend_error_max_retries"
    )
    renew_timeout = validate_ttl(_get(app, "redislock_renew_timeout"), "redislock_renew_timeout")
    return AppSettings(
        url=url,
        key_prefix=prefix,
        ttl=validate_ttl(_get(app, "redislock_ttl"), "redislock_ttl"),
        on_contention=resolve_policy(
            _get(app, "redislock_on_contention"), "redislock_on_contention"
        ),
        on_backend_error=validate_backend_error_mode(
            _get(app, "redislock_on_backend_error"), "redislock_on_backend_error"
        ),
        redis_options=dict(options),
        enabled=bool(_get(app, "redislock_enabled")),
        renew_timeout=renew_timeout,
        backend_error_max_retries=max_retries,
        enqueue=validate_enqueue_mode(_get(app, "redislock_enqueue"), "redislock_enqueue"),
        enqueue_ttl=validate_ttl(_get(app, "redislock_enqueue_ttl"), "redislock_enqueue_ttl"),
        enqueue_raise=bool(_get(app, "redislock_enqueue_raise")),
        debounce=validate_debounce(_get(app, "redislock_debounce"), "redislock_debounce"),
        debounce_max_wait=_max_wait(app),
        hold_after_success=validate_hold(
            _get(app, "redislock_hold_after_success"), "redislock_hold_after_success"
        ),
        beat_on_contention=resolve_policy(
            _get(app, "redislock_beat_on_contention"), "redislock_beat_on_contention"
        ),
        on_lost=validate_lost_mode(_get(app, "redislock_on_lost"), "redislock_on_lost"),
        min_replicas=validate_count(_get(app, "redislock_min_replicas"), "redislock_min_replicas"),
        min_replicas_timeout=validate_ttl(
            _get(app, "redislock_min_replicas_timeout"), "redislock_min_replicas_timeout"
        ),
        backend=_store_class(_get(app, "redislock_store_class"))(
            url,
            dict(options),
            renew_timeout=renew_timeout,
            fence_ttl=validate_ttl(_get(app, "redislock_fence_ttl"), "redislock_fence_ttl"),
        ),
    )


def _max_wait(app: Celery) -> float | None:
    value = _get(app, "redislock_debounce_max_wait")
    return None if value is None else validate_ttl(value, "redislock_debounce_max_wait")


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
        return cls(
            app=app,
            backend=app.backend,
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
            hold_after_success=float(pick("lock_hold_after_success", app.hold_after_success)),
            on_lost=str(pick("lock_on_lost", app.on_lost)),
            min_replicas=int(pick("lock_min_replicas", app.min_replicas)),
            min_replicas_timeout=float(pick("lock_min_replicas_timeout", app.min_replicas_timeout)),
        )


def validate_task_options(cls: type, where: str) -> None:
    """Check a task class's ``lock_*`` options when the class is made, not when it runs.

    Raises:
        ConfigurationError: an option has a bad value, or ``lock_args`` and
            ``lock_key`` are both set.
    """
    validators: dict[str, Callable[[Any, str], Any]] = {
        "lock_ttl": validate_ttl,
        "lock_enqueue_ttl": validate_ttl,
        "lock_enqueue": validate_enqueue_mode,
        "lock_debounce": validate_debounce,
        "lock_debounce_max_wait": validate_ttl,
        "lock_on_contention": resolve_policy,
        "lock_beat_on_contention": resolve_policy,
        "lock_on_lost": validate_lost_mode,
        "lock_hold_after_success": validate_hold,
        "lock_on_backend_error": validate_backend_error_mode,
        "lock_min_replicas": validate_count,
        "lock_min_replicas_timeout": validate_ttl,
    }
    for attribute, validate in validators.items():
        value = getattr(cls, attribute)
        if value is not None:
            validate(value, f"{where}: {attribute}")
    if getattr(cls, "lock_debounce", None) and getattr(cls, "lock_enqueue", None):
        raise ConfigurationError(
            f"{where}: set lock_debounce or lock_enqueue, not both (a debounced call "
            "already joins the burst's run)"
        )
    key_function = getattr(cls, "lock_key", None)
    if key_function is not None and not callable(key_function):
        raise ConfigurationError(f"{where}: lock_key must be callable, got {key_function!r}")
    if key_function is not None and getattr(cls, "lock_args", None) is not None:
        raise ConfigurationError(f"{where}: set lock_args or lock_key, not both")
