"""celery-redislock: singleton Celery tasks on a token-owned, renewed Redis lock."""

from __future__ import annotations

from importlib import metadata as _metadata

import celery_redislock.startup
import celery_redislock.sweeper  # noqa: F401  (connects the worker's sweep)
from celery_redislock.aiolock import AsyncRedisLock
from celery_redislock.exceptions import (
    AlreadyQueued,
    ConfigurationError,
    LockBackendError,
    LockContended,
    LockKeyError,
    LockLost,
    LockNotOwned,
    RedisLockError,
)
from celery_redislock.headers import LockKeyEncodeError
from celery_redislock.lease import LockHandle
from celery_redislock.lock import RedisLock
from celery_redislock.policies import (
    Contention,
    ContentionPolicy,
    HandOff,
    Raise,
    Retry,
    Skip,
    Wait,
    is_skipped,
)
from celery_redislock.request import SingletonRequest
from celery_redislock.signals import (
    lock_acquired,
    lock_contended,
    lock_lost,
    lock_released,
    lock_renewed,
)
from celery_redislock.store import ReleaseOutcome
from celery_redislock.task import SingletonTask, SingletonTaskMixin

try:
    #: The installed distribution's version (pyproject.toml's, set at install).
    __version__: str = _metadata.version("celery-redislock")
except _metadata.PackageNotFoundError:  # imported from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "AlreadyQueued",
    "AsyncRedisLock",
    "ConfigurationError",
    "Contention",
    "ContentionPolicy",
    "HandOff",
    "LockBackendError",
    "LockContended",
    "LockHandle",
    "LockKeyEncodeError",
    "LockKeyError",
    "LockLost",
    "LockNotOwned",
    "Raise",
    "RedisLock",
    "RedisLockError",
    "ReleaseOutcome",
    "Retry",
    "SingletonRequest",
    "SingletonTask",
    "SingletonTaskMixin",
    "Skip",
    "Wait",
    "__version__",
    "is_skipped",
    "lock_acquired",
    "lock_contended",
    "lock_lost",
    "lock_released",
    "lock_renewed",
]
