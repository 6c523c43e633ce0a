"""A copy of a parked call is never in the broker twice with one tag (review helper-56 F1).

The first copy granted the lock marks the call ran with its tag; a copy
with another tag is dropped, one with the same tag is taken for a
redelivery of the granted copy and runs again. kombu's publish retry sends
the same bytes again after a reply that came too late (the first send had
landed): the call ran three times. Every attempt now carries a tag of its
own: a failed publish goes to the outbox (or the next sweep) and is tagged
again there.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import kombu.exceptions
import pytest
from celery import Celery

from celery_redislock.handoff import app_pending, pack_signature, publish_copy
from celery_redislock.headers import HANDOFF_COPY_HEADER
from celery_redislock.settings import app_settings, forget_app_settings
from celery_redislock.sweeper import Sweeper
from tests.conftest import BROKER_DB, LOCK_DB
from tests.servers import FaultProxy, RedisServer, wait_until


@pytest.fixture
def slow_broker_app(server: RedisServer, proxy: FaultProxy) -> Iterator[Celery]:
    """An app whose broker (behind ``proxy``) gives up on a reply after 0.3 s."""
    app = Celery("tags", set_as_current=False)
    app.conf.update(
        broker_url=f"{proxy.url}/{BROKER_DB}",
        broker_transport_options={"socket_timeout": 0.3, "socket_connect_timeout": 1},
        broker_connection_timeout=1,
        redislock_url=server.url_for(LOCK_DB),
    )
    yield app
    forget_app_settings(app)
    app.close()


def _tags_in_the_broker(server: RedisServer, proxy: FaultProxy, at_least: int = 1) -> list[str]:
    """The copy tags of the messages of call ``t-1`` in the queue, once all sent has landed."""
    broker = server.client(BROKER_DB)

    def tags() -> list[str]:
        messages = [json.loads(raw)["headers"] for raw in broker.lrange("celery", 0, -1)]
        return [headers[HANDOFF_COPY_HEADER] for headers in messages if headers["id"] == "t-1"]

    wait_until(lambda: len(tags()) >= at_least, timeout=10, message="the messages")
    wait_until(lambda: proxy.delayed == 0, timeout=10, message="everything sent")
    return tags()


def _slow_publishes(app: Celery, proxy: FaultProxy) -> None:
    """Declare the queue (a first publish), then delay the next publish past the timeout."""
    app.signature("tags.warm").apply_async()
    proxy.slow_chunk, proxy.slow_chunk_delay = b"LPUSH", 0.5


def _woken_message(app: Celery) -> bytes:
    return pack_signature(
        app.signature(
            "tags.job",
            options={"retries": 0, "task_id": "t-1", "headers": {HANDOFF_COPY_HEADER: "w:x"}},
        ),
        "json",
    )


def test_a_copy_whose_publish_reply_comes_too_late_is_not_sent_again_with_its_tag(
    slow_broker_app: Celery, server: RedisServer, proxy: FaultProxy
) -> None:
    message = _woken_message(slow_broker_app)
    _slow_publishes(slow_broker_app, proxy)
    # Refused, or retried by kombu (the same bytes again: the fault, before).
    with contextlib.suppress(kombu.exceptions.OperationalError):
        publish_copy(slow_broker_app, message, "w")
    tags = _tags_in_the_broker(server, proxy)
    assert len(tags) == len(set(tags)) == 1, tags


def test_the_outbox_tags_each_publish_of_a_copy_again(
    slow_broker_app: Celery, server: RedisServer, proxy: FaultProxy
) -> None:
    """A sweep's publish that failed after it landed, then published again: two tags."""
    app = slow_broker_app
    settings = app_settings(app)
    index = app_pending(app, settings.backend, settings.key_prefix)
    index.put_outbox("t-1:a", _woken_message(app), 0, 60_000)
    _slow_publishes(app, proxy)
    assert Sweeper(app).sweep() == 1  # its reply came too late: put back, or retried by kombu
    assert proxy.slowed.is_set()

    def sent_twice() -> bool:
        Sweeper(app).sweep()
        return len(_tags_in_the_broker(server, proxy)) >= 2

    wait_until(sent_twice, timeout=15, message="the second try")
    tags = _tags_in_the_broker(server, proxy, at_least=2)
    assert len(tags) == len(set(tags)) == 2, tags
    assert all(tag.startswith("w:") for tag in tags)
