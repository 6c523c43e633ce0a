"""A task-option mistake found while a ``celery`` command loads the app: one line, exit 1.

Celery creates task classes while its command line loads the app module
(a task class defined in it) or builds the worker (``app.finalize()``
creates the ``@app.task`` classes, in ``setup_worker_optimizations``), both
before the worker has set up logging and before the start-up check
(:mod:`~celery_redislock.startup`) runs. A :class:`ConfigurationError`
raised there would reach the user as a traceback of 57 lines (Celery's
command line prints an app module's import errors with their traceback).
Under ``celery ...``, :func:`stop_celery_command` logs it instead as the
start-up check logs a bad setting, one CRITICAL line, and exits with
status 1; anywhere else (a producer, a test's embedded worker) the error is
raised as it is.
"""

from __future__ import annotations

import logging
import sys

import click

__all__ = ["stop_celery_command"]

logger = logging.getLogger("celery_redislock.startup")

# Celery's default log format (``worker_log_format``): the line reads as the
# worker's own CRITICAL lines do, though the worker has not set logging up yet.
_CELERY_LOG_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"


def _celery_command() -> str | None:
    """The name of the ``celery`` subcommand running now (``"worker"``), or None."""
    context = click.get_current_context(silent=True)
    celery_cli = sys.modules.get("celery.bin.celery")
    if context is None or celery_cli is None:
        return None
    if context.find_root().command is not getattr(celery_cli, "celery", None):
        return None  # another click program (the user's) that made a task class
    if context.parent is None:
        # Loading the app (``-A proj``), before the subcommand runs.
        return context.invoked_subcommand or "celery"
    return context.command.name or "celery"


def stop_celery_command(error: Exception) -> None:
    """Under ``celery <command>``: log ``error`` as one CRITICAL line and exit with status 1.

    Returns (and the caller raises the error) anywhere else.
    """
    command = _celery_command()
    if command is None:
        return
    what = "the worker" if command == "worker" else f"celery {command}"
    if logger.hasHandlers():
        logger.critical("celery-redislock: %s cannot start: %s", what, error)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_CELERY_LOG_FORMAT))
        logger.addHandler(handler)
        try:
            logger.critical("celery-redislock: %s cannot start: %s", what, error)
        finally:
            logger.removeHandler(handler)
    # SystemExit, not an Exception: Celery's app loading turns an Exception
    # into its own message with the traceback.
    raise SystemExit(1)
