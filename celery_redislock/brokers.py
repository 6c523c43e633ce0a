"""What the package's own re-sends must respect of the broker they travel through.

A re-send (a lock retry, a hand-off safety net, a backoff after a lock-store
error, a debounced run moved later) publishes the delivered message again.
Two broker constraints apply to it:

* **Headers a broker adds on delivery are not the publisher's.** RabbitMQ
  records every dead-lettering in ``x-death`` (and ``x-first-death-*``,
  ``x-last-death-*``): a countdown on quorum queues passes through kombu's
  delay queues by dead-lettering, and a re-send that copied ``x-death``
  through the same delay queues again is dropped by RabbitMQ's dead-letter
  cycle detection, without a trace. Quorum queues count redeliveries in
  ``x-delivery-count`` (and ``x-acquired-count`` from RabbitMQ 4.3); kombu's
  Redis transport marks a restored message ``redelivered``. Celery does not
  record which headers the original publisher set (a worker's
  ``request.headers`` is every header that is not Celery's own), so the rule
  is the other way round: every header is carried except those a broker or
  transport documents as its own. Celery's own ``retry()`` strips the
  ``x-death`` family for the same reason (``celery.app.task.X_DEATH_HEADERS``,
  reused here so the two stay in step).
* **Countdowns Celery can route.** With quorum queues on RabbitMQ, Celery
  (>= 5.5) sends a countdown or ETA message through native delayed
  delivery, which delays by whole seconds: it truncates the countdown
  (2.7 s is delayed 2 s) and refuses one under a second (``ValueError:
  countdown must be a positive number``). A re-send's countdown is then
  rounded *up* to whole seconds, at least 1: never earlier than intended.
  Every other broker keeps sub-second countdowns.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from celery.app import task as celery_task
from celery.utils.quorum_queues import detect_quorum_queues

__all__ = [
    "BROKER_HEADERS",
    "delays_wait_in_the_broker",
    "publisher_headers",
    "routable_countdown",
    "whole_second_delays",
    "whole_seconds",
]

#: What Celery's own retry() strips (``X_DEATH_HEADERS``; not in celery-types),
#: followed should Celery add to it.
_CELERY_STRIPS: frozenset[str] = frozenset(getattr(celery_task, "X_DEATH_HEADERS", ()))

#: Message headers a broker or transport adds to a delivered message.
BROKER_HEADERS = frozenset(
    {
        # RabbitMQ's record of dead-lettering (what Celery's retry() strips).
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
        *_CELERY_STRIPS,
        "x-delivery-count",  # quorum queues: redeliveries
        "x-acquired-count",  # quorum queues, RabbitMQ 4.3: acquisitions
        "x-received-from",  # federation: its hops, for its own cycle detection
        "x-shovelled",  # shovel (dest-add-forward-headers)
        "x-shovelled-timestamp",  # shovel (dest-add-timestamp-header)
        "x-stream-offset",  # streams: the offset a consumer read
        "redelivered",  # kombu's Redis transport, on a restored message
    }
)


def publisher_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """``headers`` without those a broker or transport added when it delivered them."""
    return {name: value for name, value in (headers or {}).items() if name not in BROKER_HEADERS}


def whole_second_delays(
    app: Any,
    task: Any,
    options: Mapping[str, Any],
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
) -> bool:
    """True if Celery would delay this message by whole seconds (native delayed delivery).

    Asks what ``send_task`` asks: quorum queues detected on an AMQP
    transport, and a destination exchange that is not direct. If the answer
    cannot be had (a router raising, say), True: rounding up is never early.
    """
    try:
        if not delays_wait_in_the_broker(app):
            return False
        routed = app.amqp.router.route(dict(options), task.name, args, kwargs, task)
    except Exception:
        return True
    queue = routed.get("queue")
    exchange_type = queue.exchange.type if queue is not None else routed.get("exchange_type")
    return bool(exchange_type != "direct")


def delays_wait_in_the_broker(app: Any) -> bool:
    """True if ``app``'s countdown messages may wait in the broker, not in a worker.

    Quorum queues on an AMQP transport: Celery's native delayed delivery
    keeps them in RabbitMQ's delay queues until due.
    """
    driver_type = app.producer_pool.connections.connection.transport.driver_type
    return bool(detect_quorum_queues(app, driver_type)[0])


def whole_seconds(countdown: float) -> float:
    """``countdown`` rounded up to whole seconds, at least 1 (0 or less: unchanged, not delayed)."""
    if countdown <= 0:
        return countdown
    return float(max(1, math.ceil(countdown)))


def routable_countdown(task: Any, signature: Any, countdown: float) -> float:
    """Give ``signature`` (a re-send of ``task``) a countdown Celery can route; return it.

    ``countdown`` itself, or where Celery delays by whole seconds,
    :func:`whole_seconds` of it.
    """
    if whole_second_delays(task.app, task, signature.options, signature.args, signature.kwargs):
        countdown = whole_seconds(countdown)
        signature.set(countdown=countdown)
    return countdown
