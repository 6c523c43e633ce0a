"""Hand-off: a contended execution parks in Redis, and the holder's release wakes it.

Runs in the worker (child and parent) and wherever a task's lock is released.
A parked execution frees its worker slot at once; it leaves two things:

* an entry in the key's queue in Redis holding the message to publish when
  the lock is handed to it (see ``PARK_SCRIPT``), and
* its own re-sent copy in the broker, due when the holder's lock would
  expire: the safety net that runs it if nobody ever wakes it (the holder's
  whole worker died, the releasing process died between its release and the
  publish, the lock store restarted and lost the queue).

The release that frees the key instead leaves the first parked execution's
hand-off value in it and returns that execution's message, which the
releasing process publishes (:func:`publisher`). Whichever of the two copies
runs first is granted the lock and marks the hand-off value as ran; the
other is then dropped as a second copy.

The message is the task's signature (``signature_from_request``), serialized
with the task's serializer and wrapped in ASCII JSON, so a client with
``decode_responses=True`` reads it back unchanged.
"""

from __future__ import annotations

import base64
import json
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kombu.serialization import dumps as kombu_dumps
from kombu.serialization import loads as kombu_loads

from celery_redislock.headers import HANDOFF_COPY_HEADER
from celery_redislock.pending import PendingIndex
from celery_redislock.tokens import new_nonce

if TYPE_CHECKING:
    from celery import Celery
    from celery.canvas import Signature

    from celery_redislock.store import LockStore

__all__ = [
    "ResendableTask",
    "app_pending",
    "marker_ttl_ms",
    "pack_message",
    "pack_signature",
    "publish_copy",
    "publisher",
    "unpack_message",
]

logger = logging.getLogger("celery_redislock.handoff")


class ResendableTask(Protocol):
    """What :func:`pack_message` uses of a task: its current request, and how to copy it."""

    @property
    def request(self) -> Any:
        """The running execution's Celery request."""

    @property
    def serializer(self) -> str | None:
        """The task's serializer."""

    def signature_from_request(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``Task.signature_from_request``."""


def pack_message(task: ResendableTask, headers: dict[str, Any]) -> bytes:
    """Return the message that re-runs the current request now, with ``headers``.

    Same task id, arguments, routing and options as the request; ``retries``
    unchanged (a hand-off never spends the task's ``max_retries``).
    """
    request = task.request
    signature = task.signature_from_request(request, retries=request.retries or 0, headers=headers)
    return pack_signature(signature, task.serializer)


def pack_signature(signature: Any, serializer: str | None) -> bytes:
    """A signature as stored in the lock store: serialized, in ASCII JSON.

    Its options should carry ``retries`` (0 for a first run), so that
    publishing it again never goes through enqueue-time dedup.
    """
    content_type, encoding, body = kombu_dumps(dict(signature), serializer=serializer or "json")
    data = body if isinstance(body, bytes) else body.encode("utf-8")
    envelope = {"ct": content_type, "ce": encoding, "b": base64.b64encode(data).decode("ascii")}
    return json.dumps(envelope, separators=(",", ":")).encode("ascii")


def app_pending(app: Celery, store: LockStore, prefix: str) -> PendingIndex:
    """``app``'s pending calls in ``store``: an index of its own, named by its main name.

    A sweep publishes through its app's broker, so apps never share one,
    even with one lock store and one prefix.
    """
    return PendingIndex(store, prefix, str(app.main or "celery"))


def marker_ttl_ms(conf: Any, enqueue_ttl: float, ttl: float) -> int:
    """How long a call's queue entries and "ran" markers live, in ms.

    A marker must outlive every other copy of its call: a copy reserved by a
    worker that died comes back from a Redis or SQS broker after the
    visibility timeout (an hour by default), and a queued run may wait
    ``enqueue_ttl``.
    """
    options = conf.broker_transport_options or {}
    redelivery = float(options.get("visibility_timeout") or 3600)
    return int((max(enqueue_ttl, redelivery) + 2 * ttl) * 1000)


def unpack_message(message: bytes) -> dict[str, Any]:
    """Return the signature dict :func:`pack_message` stored."""
    envelope = json.loads(message)
    body = base64.b64decode(envelope["b"])
    content_type = envelope["ct"]
    signature: dict[str, Any] = kombu_loads(
        body, content_type, envelope["ce"], accept={content_type}
    )
    return signature


def publish_copy(app: Celery, message: bytes, tag: str) -> Signature:
    """Publish a copy of a stored message, with a copy tag of its own; return its signature.

    Every copy of a parked (or queued, or debounced) call gets a fresh tag
    (``<tag>:<nonce>``): the first copy granted the lock marks the call ran
    with its tag, and a copy with another tag is then dropped. A copy
    published twice with one tag would run twice.
    """
    signature = app.signature(unpack_message(message))
    headers = dict(signature.options.get("headers") or {})
    headers[HANDOFF_COPY_HEADER] = f"{tag}:{new_nonce()}"
    signature.options["headers"] = headers
    signature.apply_async()
    return signature


def publisher(app: Celery) -> Callable[[str, str, bytes], None]:
    """Return the store's ``on_handoff`` hook for ``app``: publish the woken message.

    The hook holds the app weakly (the app's settings hold the store).
    """
    app_ref = weakref.ref(app)

    def publish(key: str, waiter: str, message: bytes) -> None:
        current = app_ref()
        if current is None:
            raise RuntimeError("the Celery app of this lock store is gone")
        signature = publish_copy(current, message, "w")
        logger.debug(
            "lock %s handed to parked %s[%s]", key, signature.task, signature.options["task_id"]
        )

    return publish
