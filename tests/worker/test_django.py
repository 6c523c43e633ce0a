"""DjangoSingletonTask: delay_on_commit keeps working and is deduplicated."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import AlreadyQueued
from tests.brokers import queue_length
from tests.conftest import embedded_worker
from tests.helpers import held_locks
from tests.servers import RedisServer, wait_until

django = pytest.importorskip("django")
pytest.importorskip(
    "celery.contrib.django.task", reason="DjangoTask needs Celery >= 5.4 (the django extra)"
)

pytestmark = pytest.mark.worker


@pytest.fixture(scope="module")
def django_db() -> Any:
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
            INSTALLED_APPS=["django.contrib.contenttypes"],
            USE_TZ=True,
        )
        django.setup()
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS payment (id TEXT PRIMARY KEY, status TEXT)")
    return connection


def test_delay_on_commit_publishes_once_after_commit(
    django_db: Any, app: Celery, server: RedisServer, record: redis.Redis, lock_client: redis.Redis
) -> None:
    from django.db import transaction

    from celery_redislock.contrib.django import DjangoSingletonTask

    @app.task(base=DjangoSingletonTask, shared=False, lock_enqueue=True)
    def process_payment(payment_id: str) -> str:
        record.incr("runs")
        return payment_id

    with transaction.atomic():
        with django_db.cursor() as cursor:
            cursor.execute("INSERT INTO payment VALUES ('p1', 'paid')")
        for _ in range(3):  # the same webhook three times inside one transaction
            process_payment.delay_on_commit("p1")
        assert queue_length(app) == 0  # nothing before COMMIT
    wait_until(lambda: queue_length(app) == 1, timeout=10)  # one publish after COMMIT
    with embedded_worker(app, "threads", 2):
        key = process_payment.lock_key_for(("p1",), {})
        wait_until(lambda: record.get("runs") == "1" and not lock_client.exists(key), timeout=20)


@pytest.mark.parametrize("method", ["delay_on_commit", "apply_async_on_commit"])
def test_a_duplicate_after_commit_does_not_raise_or_stop_the_other_callbacks(
    django_db: Any, app: Celery, server: RedisServer, method: str
) -> None:
    """lock_enqueue_raise=True: the transaction has committed when the duplicate is found.

    Raised from Django's on_commit, AlreadyQueued came out of the ``with``
    block of a committed transaction and stopped the callbacks after it:
    the unrelated task below was never published (review helper-29).
    """
    from django.db import transaction

    from celery_redislock.contrib.django import DjangoSingletonTask

    @app.task(base=DjangoSingletonTask, shared=False, lock_enqueue=True, lock_enqueue_raise=True)
    def pay(payment_id: str) -> str:
        return payment_id

    @app.task(base=DjangoSingletonTask, shared=False, lock_enabled=False)
    def notify(payment_id: str) -> str:
        return payment_id

    with transaction.atomic():
        for _ in range(2):
            if method == "delay_on_commit":
                pay.delay_on_commit("p8")
            else:
                pay.apply_async_on_commit(("p8",))
        notify.delay_on_commit("p8")
    wait_until(lambda: queue_length(app) == 2, timeout=10)  # one pay, one notify
    with pytest.raises(AlreadyQueued):
        pay.delay("p8")  # outside on_commit the setting still raises


def test_rollback_publishes_nothing_and_leaves_no_lock(
    django_db: Any, app: Celery, server: RedisServer, lock_client: redis.Redis
) -> None:
    from django.db import transaction

    from celery_redislock.contrib.django import DjangoSingletonTask

    @app.task(base=DjangoSingletonTask, shared=False, lock_enqueue=True)
    def process_payment(payment_id: str) -> str:
        return payment_id

    with pytest.raises(RuntimeError), transaction.atomic():
        process_payment.delay_on_commit("p2")
        raise RuntimeError("rolled back")
    assert queue_length(app) == 0
    assert held_locks(lock_client) == []


def test_app_wide_task_cls(django_db: Any, server: RedisServer) -> None:
    from celery_redislock.contrib.django import DjangoSingletonTask
    from tests.conftest import make_app

    conf = make_app(server).conf
    app = Celery(
        "django-wide",
        task_cls="celery_redislock.contrib.django:DjangoSingletonTask",
        set_as_current=False,
    )
    app.conf.update({key: conf[key] for key in ("broker_url", "result_backend", "redislock_url")})

    @app.task(shared=False)
    def anything(x: int) -> int:
        return x

    assert isinstance(anything, DjangoSingletonTask)
    assert hasattr(anything, "delay_on_commit")
    assert anything.apply((3,)).get() == 3
    app.close()
