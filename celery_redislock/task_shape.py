"""The members of a lock-taking task that the modules running its steps may use.

``task.py`` imports the modules that publish a call (``enqueue``), run it
(``execution`` and its parts) and park it (``handoff``). Those annotate the
task with :class:`LockedTask`, never with the task class, so no module
imports ``task.py`` back, not even for the type checker. May import: the
typing-only names of ``settings`` and ``lease``, and ``handoff``'s protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from celery_redislock.handoff import ResendableTask

if TYPE_CHECKING:
    from celery import Celery

    from celery_redislock.lease import LockHandle
    from celery_redislock.settings import TaskSettings

__all__ = ["LockedTask"]


class LockedTask(ResendableTask, Protocol):
    """What ``enqueue``, ``execution``, ``parking`` and ``resend`` use of a ``SingletonTask``."""

    @property
    def name(self) -> str:
        """The task's registered name."""

    @property
    def app(self) -> Celery:
        """The Celery app the task is bound to."""

    @property
    def acks_late(self) -> bool:
        """Whether the message is acknowledged only after the run."""

    @property
    def expires(self) -> Any:
        """Celery's default ``expires`` of the task's calls (``None``: none)."""

    @property
    def backend(self) -> Any:
        """The task's result backend."""

    @property
    def ignore_result(self) -> bool:
        """Whether the task's results are not stored."""

    @property
    def store_errors_even_if_ignored(self) -> bool:
        """Whether a failure is stored although results are not."""

    def lock_settings(self) -> TaskSettings:
        """The task's effective settings."""

    def lock_key_for_received(
        self,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        settings: TaskSettings | None = None,
    ) -> str:
        """The key of a call whose arguments are as the worker receives them."""

    def on_lock_lost(self, handle: LockHandle) -> None:
        """The hook a lost lock calls."""

    def signature(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``Task.signature``."""

    def send_event(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``Task.send_event``."""

    def AsyncResult(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``Task.AsyncResult``."""
