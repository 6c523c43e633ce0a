"""What a re-send keeps of the delivered headers, and which countdowns it may use."""

from __future__ import annotations

import pytest
from celery import Celery
from celery.app.task import X_DEATH_HEADERS  # type: ignore[attr-defined]

from celery_redislock.brokers import (
    BROKER_HEADERS,
    publisher_headers,
    whole_second_delays,
    whole_seconds,
)

DELIVERED = {
    "tenant": "t-1",  # the caller's
    "x-request-id": "req-1",  # the caller's, though it starts with x-
    "redislock_lock_retries": 2,  # the package's
    "x-death": [{"queue": "celery_delayed_0", "reason": "expired", "count": 1}],
    "x-first-death-queue": "celery_delayed_1",
    "x-first-death-reason": "expired",
    "x-first-death-exchange": "celery_delayed_1",
    "x-last-death-queue": "celery_delayed_0",
    "x-last-death-reason": "expired",
    "x-last-death-exchange": "celery_delayed_0",
    "x-delivery-count": 1,
    "redelivered": True,
}


def test_a_resend_keeps_the_callers_and_the_packages_headers_only() -> None:
    assert publisher_headers(DELIVERED) == {
        "tenant": "t-1",
        "x-request-id": "req-1",
        "redislock_lock_retries": 2,
    }
    assert publisher_headers(None) == {}


def test_every_header_celerys_own_retry_strips_is_stripped_too() -> None:
    assert set(X_DEATH_HEADERS) <= BROKER_HEADERS


@pytest.mark.parametrize(
    ("countdown", "routable"),
    [(0.3, 1.0), (1.0, 1.0), (1.01, 2.0), (2.7, 3.0), (3.0, 3.0), (0.0, 0.0), (-1.0, -1.0)],
)
def test_whole_seconds_round_up_never_earlier(countdown: float, routable: float) -> None:
    assert whole_seconds(countdown) == routable


def _app(broker_url: str, **conf: object) -> Celery:
    app = Celery("brokers-unit", set_as_current=False, set_as_default=False)
    app.conf.update(broker_url=broker_url, task_default_queue="tests", **conf)
    return app


QUORUM = {"task_default_queue_type": "quorum", "task_default_exchange_type": "topic"}


@pytest.mark.parametrize(
    ("broker_url", "conf", "whole"),
    [
        ("amqp://guest:guest@127.0.0.1:1//", QUORUM, True),
        # Celery warns and does not use native delayed delivery through a direct exchange.
        ("amqp://guest:guest@127.0.0.1:1//", {"task_default_queue_type": "quorum"}, False),
        ("amqp://guest:guest@127.0.0.1:1//", {}, False),  # classic queues
        ("redis://127.0.0.1:1/0", QUORUM, False),  # queue types are RabbitMQ's
    ],
)
def test_whole_second_delays_where_celery_uses_native_delayed_delivery(
    broker_url: str, conf: dict[str, object], whole: bool
) -> None:
    """Read off the app's settings, as ``send_task`` does: no connection is made."""
    app = _app(broker_url, **conf)

    @app.task(shared=False)
    def job() -> None: ...

    try:
        assert whole_second_delays(app, job, {}, (), {}) is whole
    finally:
        app.close()


def test_the_route_decides_the_exchange() -> None:
    """A task routed to a queue with a direct exchange is not delayed natively."""
    from kombu import Exchange, Queue

    quorum = {"x-queue-type": "quorum"}
    app = _app(
        "amqp://guest:guest@127.0.0.1:1//",
        task_queues=[
            Queue("tests", Exchange("tests", type="topic"), "tests", queue_arguments=quorum),
            Queue("direct", Exchange("direct", type="direct"), "direct", queue_arguments=quorum),
        ],
        task_routes={"unit.routed": {"queue": "direct"}},
    )

    @app.task(shared=False, name="unit.routed")
    def routed() -> None: ...

    @app.task(shared=False, name="unit.default")
    def default() -> None: ...

    try:
        assert whole_second_delays(app, routed, {}, (), {}) is False
        assert whole_second_delays(app, default, {}, (), {}) is True
    finally:
        app.close()
