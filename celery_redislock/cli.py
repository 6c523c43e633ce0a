"""``celery -A proj redislock ...``: list, inspect and repair locks.

Registered under the ``celery.commands`` entry point, so it shows in
``celery --help`` and uses the app given with ``-A``. The work is done by
:class:`~celery_redislock.admin.LockInventory`; this module only parses
options and prints.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import wraps
from typing import Any, TypeVar

import click
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options

from celery_redislock.admin import LockInventory, LockRecord
from celery_redislock.exceptions import RedisLockError
from celery_redislock.store import ReleaseOutcome

__all__ = ["redislock"]

F = TypeVar("F", bound=Callable[..., Any])

_COLUMNS = ("KEY", "TASK", "TASK ID", "STATE", "SLOT", "HOST", "PID", "AGE", "TTL", "FENCE")


def _inventory(ctx: click.Context) -> LockInventory:
    app = ctx.obj.app
    # The task modules a worker imports (``include``, ``imports``, Django's
    # autodiscovery): without them a task's own TTL is unknown, and so is
    # whether its lock is still renewed. One that fails to import (a
    # dependency missing on this host) must not keep an operator from the
    # locks: its tasks' locks count as live.
    try:
        app.loader.import_default_modules()
    except Exception as exc:
        click.echo(
            f"warning: the app's task modules did not all import ({type(exc).__name__}: "
            f"{exc}); locks of tasks not registered count as live",
            err=True,
        )
    return LockInventory(app)


def _clear_errors(command: F) -> F:
    """Turn the package's errors (bad settings, Redis down) into a one-line CLI error."""

    @wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except RedisLockError as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper  # type: ignore[return-value]


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 3600:
        return f"{value / 3600:.1f}h"
    if value >= 60:
        return f"{value / 60:.1f}m"
    return f"{value:.1f}s"


def _row(record: LockRecord) -> tuple[str, ...]:
    return (
        record.key,
        record.task_name or "-",
        record.task_id or "-",
        record.state,
        str(record.slot),
        record.hostname or "-",
        "-" if record.pid is None else str(record.pid),
        _seconds(record.age()),
        _seconds(record.ttl_remaining),
        "-" if record.fence is None else str(record.fence),
    )


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in (_COLUMNS, *rows)) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (_COLUMNS, *rows)
    ]
    return "\n".join(lines)


def _find(inventory: LockInventory, key_or_task_id: str) -> LockRecord:
    record = inventory.find(key_or_task_id)
    if record is None:
        raise click.ClickException(
            f"no lock found for {key_or_task_id!r} (neither a held key under "
            f"'{inventory.prefix}:' nor the task id of a holder)"
        )
    return record


@click.group(name="redislock")
@click.pass_context
@handle_preload_options
def redislock(ctx: click.Context) -> None:
    """List, inspect and release celery-redislock locks."""


@redislock.command(cls=CeleryCommand, name="ls")
@click.option("--task", "task_name", cls=CeleryOption, help="Only locks taken by this task.")
@click.option("--json", "as_json", cls=CeleryOption, is_flag=True, help="Print JSON.")
@click.pass_context
@_clear_errors
def list_locks(ctx: click.Context, /, task_name: str | None, as_json: bool, **_: Any) -> None:
    """List every held lock: task, holder, slot, host and pid, age, TTL left, fence."""
    records = _inventory(ctx).locks(task=task_name)
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in records], indent=2))
        return
    if not records:
        click.echo("no locks held")
        return
    click.echo(_table([_row(r) for r in records]))


@redislock.command(cls=CeleryCommand)
@click.argument("key_or_task_id")
@click.option("--json", "as_json", cls=CeleryOption, is_flag=True, help="Print JSON.")
@click.pass_context
@_clear_errors
def show(ctx: click.Context, /, key_or_task_id: str, as_json: bool, **_: Any) -> None:
    """Show one lock in full, by key or by the holder's task id."""
    inventory = _inventory(ctx)
    record = _find(inventory, key_or_task_id)
    details = {**record.as_dict(), "live": inventory.is_live(record)}
    if as_json:
        click.echo(json.dumps(details, indent=2))
        return
    for name, value in details.items():
        if name in ("age", "ttl_remaining"):
            value = _seconds(value)
        click.echo(f"{name + ':':<15}{'-' if value is None else value}")


@redislock.command(cls=CeleryCommand)
@click.argument("key_or_task_id")
@click.option("-f", "--force", cls=CeleryOption, is_flag=True, help="Release without asking first.")
@click.pass_context
@_clear_errors
def release(ctx: click.Context, /, key_or_task_id: str, force: bool, **_: Any) -> None:
    """Release one stuck lock (compare-and-delete: only the holder read here).

    The holder's task, if still running, is not stopped and loses its lock:
    another run may start at once.
    """
    inventory = _inventory(ctx)
    record = _find(inventory, key_or_task_id)
    if not force:
        live = ""
        if inventory.is_live(record):
            live = " It was taken or renewed within the last renewal interval: "
            live += "its holder may be alive."
        click.confirm(
            f"Release {record.key} held by task {record.task_id} "
            f"({record.task_name}) on {record.hostname}?{live}",
            abort=True,
        )
    outcome = inventory.release(record)
    if outcome is ReleaseOutcome.RELEASED:
        click.echo(f"released {record.key}")
    elif outcome is ReleaseOutcome.ALREADY_GONE:
        click.echo(f"{record.key} was already released")
    else:
        raise click.ClickException(f"{record.key} changed hands meanwhile; left alone")


@redislock.command(cls=CeleryCommand)
@click.option("--task", "task_name", cls=CeleryOption, required=True, help="Task name.")
@click.option("-f", "--force", cls=CeleryOption, is_flag=True, help="Release without asking first.")
@click.option(
    "--include-live",
    cls=CeleryOption,
    is_flag=True,
    help="Also release locks whose holder still renews them.",
)
@click.pass_context
@_clear_errors
def purge(ctx: click.Context, /, task_name: str, force: bool, include_live: bool, **_: Any) -> None:
    """Release every lock of one task, except those still renewed (see --include-live).

    A lock counts as live when its TTL was reset within the last renewal
    interval (TTL/3, plus 1 s): its holder, or at least its renewer, is
    running. Queued keys (taken at enqueue) are never live.
    """
    inventory = _inventory(ctx)
    records = inventory.locks(task=task_name)
    live = [r for r in records if inventory.is_live(r)]
    targets = records if include_live else [r for r in records if r not in live]
    if not targets:
        click.echo(f"nothing to release for {task_name} ({len(live)} live lock(s) kept)")
        return
    if not force:
        click.confirm(f"Release {len(targets)} lock(s) of {task_name}?", abort=True)
    released = sum(inventory.release(r) is not ReleaseOutcome.NOT_OURS for r in targets)
    kept = "" if include_live else f", kept {len(live)} live"
    click.echo(f"released {released} lock(s) of {task_name}{kept}")
