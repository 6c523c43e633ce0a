"""The Celery app configuration every bench worker shares."""

from __future__ import annotations

import os

from celery import Celery


def broker_url() -> str:
    """The broker server (database 0; tasks record what they did in database 3)."""
    return os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379").rstrip("/")


def lock_url() -> str:
    """The lock store every contender uses: its own server, so its commands can be counted."""
    return os.environ.get("BENCH_LOCK_URL", "redis://127.0.0.1:6379").rstrip("/")


def bench_app(name: str, prefetch: int) -> Celery:
    """Return an app whose contenders all lock in the lock store.

    The URLs are read now, from the environment: each scenario starts its
    own servers and sets them before importing the task module.
    """
    BROKER, LOCKS = broker_url(), lock_url()
    app = Celery(name)
    app.conf.update(
        broker_url=f"{BROKER}/0",
        task_ignore_result=True,
        worker_prefetch_multiplier=prefetch,
        broker_connection_retry_on_startup=True,
        redislock_url=f"{LOCKS}/0",
        singleton_backend_url=f"{LOCKS}/0",
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": f"{LOCKS}/0", "default_timeout": 3600},
        },
    )
    return app
