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
from typing import TYPE_CHECKING, Any

from kombu.serialization import dumps as kombu_dumps
from kombu.serialization import loads as kombu_loads

if TYPE_CHECKING:
    from celery import Celery

    from celery_redislock.task import SingletonTaskMixin

__all__ = ["pack_message", "publisher", "unpack_message"]

logger = logging.getLogger("celery_redislock.handoff")


def pack_message(task: SingletonTaskMixin, headers: dict[str, Any]) -> bytes:
    """Return the message that re-runs the current request now, with ``headers``.

    Same task id, arguments, routing and options as the request; ``retries``
    unchanged (a hand-off never spends the task's ``max_retries``).
    """
    request = task.request
    signature = task.signature_from_request(request, retries=request.retries or 0, headers=headers)
    content_type, encoding, body = kombu_dumps(
        dict(signature), serializer=task.serializer or "json"
    )
    data = body if isinstance(body, bytes) else body.encode("utf-8")
    envelope = {"ct": content_type, "ce": encoding, "b": base64.b64encode(data).decode("ascii")}
    return json.dumps(envelope, separators=(",", ":")).encode("ascii")


def unpack_message(message: bytes) -> dict[str, Any]:
    """Return the signature dict :func:`pack_message` stored."""
    envelope = json.loads(message)
    body = base64.b64decode(envelope["b"])
    content_type = envelope["ct"]
    signature: dict[str, Any] = kombu_loads(
        body, content_type, envelope["ce"], accept={content_type}
    )
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
        signature = current.signature(unpack_message(message))
        signature.apply_async()
        logger.debug(
            "lock %s handed to parked %s[%s]", key, signature.task, signature.options["task_id"]
        )

    return publish
