"""Celery signals sent by the lock, for logging, metrics and alerts.

Every signal is sent with ``sender`` = the task (or the :class:`RedisLock`)
and these keyword arguments: ``key``, ``task_name``, ``task_id`` (``None``
outside a task) and the ones listed per signal. Receivers run in the process
and thread where the event happened; an exception in a receiver is logged by
Celery and never reaches the task.

==================  =============================================  ==========================
signal              when                                           extra arguments
==================  =============================================  ==========================
``lock_acquired``   the lock was taken, before the body runs       ``waited`` (s), ``fence``
``lock_contended``  the lock was held by someone else              ``holder_task_id``,
                                                                   ``ttl_remaining`` (s),
                                                                   ``policy`` (outcome name)
``lock_renewed``    the renewer extended the lock (renewer thread) ``held`` (s)
``lock_lost``       the renewer found the lock gone or taken over  ``reason``, ``held`` (s)
                    (renewer thread); sent once per acquisition
``lock_released``   the holder released the lock                   ``held`` (s), ``outcome``
==================  =============================================  ==========================
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_contended", "lock_lost", "lock_released", "lock_renewed"]

_COMMON = ["key", "task_name", "task_id"]

lock_acquired = Signal(name="lock_acquired", providing_args=[*_COMMON, "waited", "fence"])
lock_contended = Signal(
    name="lock_contended",
    providing_args=[*_COMMON, "holder_task_id", "ttl_remaining", "policy"],
)
lock_renewed = Signal(name="lock_renewed", providing_args=[*_COMMON, "held"])
lock_lost = Signal(name="lock_lost", providing_args=[*_COMMON, "reason", "held"])
lock_released = Signal(name="lock_released", providing_args=[*_COMMON, "held", "outcome"])
