"""``SingletonTask``: where a Celery task takes its lock, runs, and gives the lock back.

The path of one call, and the module that does each step:

* ``delay``/``apply_async`` (producer): published as usual, or with
  ``lock_enqueue`` only if its key is free (:mod:`~celery_redislock.enqueue`);
* the worker calls :meth:`SingletonTaskMixin.__call__` for every execution,
  eager or in a worker. It takes the lock before the body and gives it back
  in a ``finally``, in one stack frame (:mod:`~celery_redislock.execution`);
  the ``finally`` runs for every outcome inside the process: success,
  exception, ``self.retry()``, ``Ignore``, ``Reject``,
  ``SoftTimeLimitExceeded`` and the ``SystemExit`` that revoke-with-terminate,
  cold shutdown and the hard time limit's SIGTERM raise in a pool child. It
  runs before Celery stores the result, so ``result.get()`` returning means
  the lock is free;
* while the body runs, the process's renewer keeps the lock alive
  (:mod:`~celery_redislock.renewer`), and a lost lock can abort the body
  (:mod:`~celery_redislock.abort`);
* when a pool child dies holding its lock, the worker's parent releases it
  once the child has exited (:mod:`~celery_redislock.request`).

Direct calls (``task(x)``) are plain function calls, as in Celery, and take
no lock; ``task.apply()`` and ``task_always_eager`` do lock.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from celery import Task
from celery.exceptions import Retry as CeleryRetry

from celery_redislock._local import ExecutionStack
from celery_redislock.command_line import stop_celery_command
from celery_redislock.enqueue import publish_once
from celery_redislock.exceptions import ConfigurationError
from celery_redislock.execution import Execution
from celery_redislock.headers import (
    BACKEND_RETRIES_HEADER,
    LOCK_RETRIES_HEADER,
    QUEUED_TOKEN_HEADER,
    REDELIVERED_HEADER,
    UNSETTLED_HEADER,
    as_received,
)
from celery_redislock.key_family import plain_key
from celery_redislock.keys import (
    bind_lock_arguments,
    custom_key,
    plain_parameter_names,
    task_key,
)
from celery_redislock.lease import LockHandle
from celery_redislock.policies import ContentionPolicy
from celery_redislock.resend import CONTENTION_EVENT
from celery_redislock.settings import AppSettings, TaskSettings, app_settings, validate_task_options
from celery_redislock.validators import validate_lock_args

__all__ = [
    "BACKEND_RETRIES_HEADER",
    "CONTENTION_EVENT",
    "LOCK_RETRIES_HEADER",
    "QUEUED_TOKEN_HEADER",
    "REDELIVERED_HEADER",
    "UNSETTLED_HEADER",
    "SingletonTask",
    "SingletonTaskMixin",
]

if TYPE_CHECKING:
    _TaskBase = Task[Any, Any]
    _Task = Task[Any, Any]
else:
    _TaskBase = object
    _Task = Task


def _run_signature(cls: type) -> inspect.Signature | None:
    """Return the signature of ``cls.run`` without ``self``, or None if abstract."""
    for klass in cls.__mro__:
        if "run" in vars(klass):
            attribute = vars(klass)["run"]
            break
    else:
        return None
    if klass is Task:
        return None
    if isinstance(attribute, staticmethod):
        return inspect.signature(attribute.__func__)
    signature = inspect.signature(attribute)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


class SingletonTaskMixin(_TaskBase):
    """Makes a Celery task a singleton per lock key; combine with any Task base.

    Attributes set on the class or as ``@app.task(...)`` options; ``None``
    inherits the app setting of the same meaning. Besides the two below,
    each ``lock_*`` attribute is the task's spelling of an app setting,
    documented once in ``settings.SETTINGS`` (the README's Configuration
    table): ``lock_ttl``, ``lock_on_contention``, ``lock_enqueue``,
    ``lock_debounce``, ``lock_limit`` and the rest.

    Attributes:
        lock_args: Names of the ``run`` parameters that make up the key;
            ``None`` uses all of them, ``()`` the task name alone.
        lock_key: ``callable(args, kwargs) -> str`` giving the key yourself;
            tasks returning the same string share one lock.
    """

    lock_args: Sequence[str] | None = None
    lock_key: Callable[[tuple[Any, ...], dict[str, Any]], str] | None = None
    lock_ttl: float | None = None
    lock_on_contention: str | ContentionPolicy | None = None
    lock_on_backend_error: str | None = None
    lock_enabled: bool | None = None
    lock_enqueue: bool | str | None = None
    lock_enqueue_ttl: float | None = None
    lock_enqueue_raise: bool | None = None
    lock_debounce: float | None = None
    lock_debounce_max_wait: float | None = None
    lock_hold_after_success: float | None = None
    lock_beat_on_contention: str | ContentionPolicy | None = None
    lock_on_lost: str | None = None
    lock_min_replicas: int | None = None
    lock_min_replicas_timeout: float | None = None
    lock_limit: int | None = None

    #: The worker's request class; it adds the parent-side release.
    Request = "celery_redislock.request:SingletonRequest"

    _redislock_signature: inspect.Signature | None = None
    _redislock_plain_names: tuple[str, ...] | None = None
    # Thread- (or greenlet-) local, like Celery's request stack: one task
    # instance serves every thread of the threads pool at once.
    _redislock_held: ExecutionStack[Execution] = ExecutionStack()
    _redislock_settings: tuple[AppSettings, TaskSettings] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        where = f"task {vars(cls).get('name') or cls.__qualname__}"
        cls._redislock_signature = signature = _run_signature(cls)
        cls._redislock_plain_names = None if signature is None else plain_parameter_names(signature)
        cls._redislock_held = ExecutionStack()
        try:
            validate_task_options(cls, where, SingletonTaskMixin)
            if cls.lock_args is not None and cls._redislock_signature is not None:
                validate_lock_args(cls._redislock_signature, cls.lock_args, where)
        except ConfigurationError as exc:
            stop_celery_command(exc)  # under `celery worker`: one CRITICAL line, exit 1
            raise

    # -- public helpers ----------------------------------------------------------

    @property
    def lock(self) -> LockHandle | None:
        """The lock held by the running execution (``None`` when unlocked).

        ``self.lock.lost`` turns True if the renewer finds the lock gone or
        taken over; ``self.lock.owned`` is a zero-round-trip validity check.
        """
        execution: Execution | None = self._redislock_held.top
        return None if execution is None else execution.handle

    def lock_key_for(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        """Return the lock key of a call with ``args`` and ``kwargs``.

        It is the key the worker computes from the message: the arguments
        are taken through the task's serializer first (a tuple arrives as a
        list under JSON, a NumPy float as a plain float).

        Raises:
            LockKeyError: the arguments cannot be serialized or keyed.
        """
        settings = self.lock_settings()
        args, kwargs = as_received(args, kwargs or {}, self.serializer, self.name)
        return plain_key(self.lock_key_for_received(args, kwargs, settings))  # yours to send

    def lock_key_for_received(
        self, args: Sequence[Any], kwargs: dict[str, Any], settings: TaskSettings | None = None
    ) -> str:
        """Return the lock key of a call whose arguments are as the worker receives them.

        :meth:`lock_key_for` without the serializer round trip: for the
        arguments of a message (``request.args``) or ones already taken
        through it (:func:`~celery_redislock.headers.as_received`).
        ``settings`` saves a look-up when the caller has them.

        Raises:
            LockKeyError: the arguments cannot be keyed.
        """
        prefix = (settings or self.lock_settings()).app.key_prefix
        key_function = type(self).lock_key
        if key_function is not None:
            return custom_key(prefix, key_function, args, kwargs or {}, self.name)
        signature = self._redislock_signature
        plain_names = self._redislock_plain_names
        if signature is None:
            signature, plain_names = inspect.signature(self.run), None
        lock_args = None if self.lock_args is None else tuple(self.lock_args)
        arguments = bind_lock_arguments(
            signature, args, kwargs or {}, lock_args, self.name, plain_names
        )
        return task_key(prefix, self.name, arguments)

    def lock_settings(self) -> TaskSettings:
        """Return the task's effective settings: its ``lock_*`` attributes over the app's.

        Read on first use and cached until the app's settings are read again.

        Raises:
            ConfigurationError: a setting has an unusable value.
        """
        app = app_settings(self.app)
        cached = self._redislock_settings
        if cached is None or cached[0] is not app:
            cached = (app, TaskSettings.merge(self, app))
            self._redislock_settings = cached
        return cached[1]

    _lock_settings = lock_settings  # the name the tests use

    # -- enqueue time ------------------------------------------------------------------

    def apply_async(  # type: ignore[override]
        self,
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> Any:
        """Publish the task; with ``lock_enqueue``, only if its key is free.

        A duplicate is not published: it returns the holder's ``AsyncResult``
        (so ``.get()`` gives the first task's result), or raises
        :class:`AlreadyQueued` with ``lock_enqueue_raise``. See
        :func:`celery_redislock.enqueue.publish_once`.
        """
        return publish_once(self, super().apply_async, args, kwargs, options)

    # -- the execution ---------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body under the lock: take it, run, give it back in one ``try/finally``.

        Whatever lands between two lines (a soft time limit, an abort, a
        SIGTERM-born ``SystemExit``, ``KeyboardInterrupt``), the ``finally``
        gives back exactly what was taken: the lock if granted, or the value
        an acquire may have stored if it was interrupted before its reply.
        """
        request = self.request
        if request.called_directly:
            return super().__call__(*args, **kwargs)
        running: Execution | None = self._redislock_held.top
        if running is not None and running.request.id == request.id:
            # Called from inside its own running body (``job(x)`` in ``job``):
            # the request is a copy of the running one (same id; the stack is
            # this thread's), so it would look like the running delivery, and
            # the same key like a redelivered copy of it (retried until the
            # holder, itself, ends: endless in eager mode). It is a
            # direct call: a plain function call in the execution that holds
            # the lock, with no lock of its own (see the README).
            return super().__call__(*args, **kwargs)
        settings = self.lock_settings()
        if not settings.enabled:
            return super().__call__(*args, **kwargs)
        execution = Execution(self, settings, args, kwargs, self._redislock_held)
        try:
            decision = execution.take_lock()
            if decision is not None:
                return decision.result
            self._redislock_held.push(execution)
            result = super().__call__(*args, **kwargs)
            execution.succeeded()
            return result
        except CeleryRetry as retry:
            execution.retrying(retry)
            raise
        finally:
            # Inline, not in a helper: an exception landing on a helper's
            # first instruction would escape before its own ``try``.
            try:
                execution.give_back()
            except BaseException:
                execution.give_back()  # once more, then re-raise: deferred, not lost
                raise

    def on_lock_lost(self, handle: LockHandle) -> None:
        """Called from the renewer thread when this execution's lock is lost.

        Override it to react (it must not block). The default does nothing:
        the loss is already logged, signalled and visible as
        ``self.lock.lost``.
        """


class SingletonTask(SingletonTaskMixin, _Task):
    """A Celery ``Task`` that runs at most once at a time per lock key."""
