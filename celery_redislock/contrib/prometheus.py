"""Prometheus metrics for locks, fed by the package's signals.

Install the extra (``pip install 'celery-redislock[prometheus]'``) and
connect the metrics to a registry you own, in every worker process::

    from prometheus_client import CollectorRegistry
    from celery_redislock.contrib.prometheus import LockMetrics

    metrics = LockMetrics(registry).connect()

The library never starts an HTTP server or touches the default registry:
expose ``registry`` the way your workers already do (for prefork workers,
prometheus_client's multiprocess mode). ``metrics.disconnect()`` stops
counting.

Metrics (``task`` is the task name, or ``""`` for a standalone lock):

=========================================  =========  ===========================
name                                       type       labels
=========================================  =========  ===========================
``celery_redislock_acquired_total``        counter    ``task``
``celery_redislock_contended_total``       counter    ``task``, ``policy``
``celery_redislock_lost_total``            counter    ``task``, ``reason``
``celery_redislock_released_total``        counter    ``task``, ``outcome``
``celery_redislock_hold_seconds``          histogram  ``task``
``celery_redislock_wait_seconds``          histogram  ``task``
=========================================  =========  ===========================

``policy`` is what the contention led to: ``skip``, ``retry``, ``raise``,
``wait`` or ``deduplicated`` (a duplicate not published, with
``lock_enqueue``). ``outcome`` is ``released``, ``kept`` (handed back to a
queued retry or kept as an idempotency window), ``already_gone`` or
``not_ours``. ``wait_seconds`` is the time from asking for the lock to
getting it: near zero unless the ``wait`` policy waited.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from celery_redislock import signals

__all__ = ["LockMetrics"]

#: Hold times span no-op tasks to hour-long jobs.
HOLD_BUCKETS = (0.005, 0.025, 0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, float("inf"))
#: Waits are short unless the wait policy queues behind a long holder.
WAIT_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.5, 1, 5, 30, 120, float("inf"))


def _task(fields: dict[str, Any]) -> str:
    # A standalone lock's signals carry its name as task_name and no task id:
    # one label value per lock name would grow without bound.
    if fields.get("task_id") is None:
        return ""
    return str(fields.get("task_name") or "")


class LockMetrics:
    """Counters and histograms for one registry, updated from the lock signals.

    Args:
        registry: Where the metrics are registered.
        namespace: Metric name prefix.
    """

    def __init__(self, registry: CollectorRegistry, namespace: str = "celery_redislock") -> None:
        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"{namespace}_{name}", doc, ["task", *labels], registry=registry)

        self.acquired = counter("acquired", "Locks taken.")
        self.contended = counter("contended", "Lock requests that found it held.", "policy")
        self.lost = counter("lost", "Held locks lost before release.", "reason")
        self.released = counter("released", "Lock releases by the holder.", "outcome")
        self.hold_seconds = Histogram(
            f"{namespace}_hold_seconds",
            "Seconds a lock was held, until its release.",
            ["task"],
            registry=registry,
            buckets=HOLD_BUCKETS,
        )
        self.wait_seconds = Histogram(
            f"{namespace}_wait_seconds",
            "Seconds from asking for a lock to holding it.",
            ["task"],
            registry=registry,
            buckets=WAIT_BUCKETS,
        )
        self._receivers = (
            (signals.lock_acquired, self._on_acquired),
            (signals.lock_contended, self._on_contended),
            (signals.lock_lost, self._on_lost),
            (signals.lock_released, self._on_released),
        )

    def connect(self) -> LockMetrics:
        """Start counting (idempotent); returns ``self``."""
        for signal, receiver in self._receivers:
            signal.connect(receiver, weak=False, dispatch_uid=self._uid(receiver))
        return self

    def disconnect(self) -> None:
        """Stop counting."""
        for signal, receiver in self._receivers:
            signal.disconnect(receiver, dispatch_uid=self._uid(receiver))

    def _uid(self, receiver: Any) -> str:
        return f"celery_redislock.prometheus:{id(self)}:{receiver.__name__}"

    def _on_acquired(self, sender: Any = None, **fields: Any) -> None:
        task = _task(fields)
        self.acquired.labels(task).inc()
        self.wait_seconds.labels(task).observe(max(float(fields.get("waited") or 0.0), 0.0))

    def _on_contended(self, sender: Any = None, **fields: Any) -> None:
        self.contended.labels(_task(fields), str(fields.get("policy"))).inc()

    def _on_lost(self, sender: Any = None, **fields: Any) -> None:
        self.lost.labels(_task(fields), str(fields.get("reason"))).inc()

    def _on_released(self, sender: Any = None, **fields: Any) -> None:
        task = _task(fields)
        self.released.labels(task, str(fields.get("outcome"))).inc()
        self.hold_seconds.labels(task).observe(max(float(fields.get("held") or 0.0), 0.0))
