"""Compatibility matrix: Python x Celery x redis-py, running the worker-level tests.

``make matrix`` (``nox -s matrix``) runs every cell; ``make matrix-ci``
(``nox -s matrix_ci``) the bounded subset CI runs. Each cell gets its own
virtualenv under ``.nox/``, installs the package with its test extra and the
cell's exact Celery and redis-py versions, and runs ``tests/worker`` and
``tests/unit`` and the TLS test (real ``redis-server`` processes, embedded
workers, a real Flower). Each cell appends one row (installed versions, test
counts, seconds) to ``.nox/matrix.md``.

The bounds, as ``pyproject.toml`` states them: ``celery[redis]>=5.6``,
``redis>=5.3``, Python >= 3.10; the lowest cell pins exactly those (5.6.0,
5.3.0) and pip picks the newest kombu and the rest that fit, as it would for
a user pinning these two. Celery's bound was 5.3 until this matrix ran it:
Celery 5.3.0 and 5.4.0 lost the lock-retry budget header of the re-sent
message (``test_retry_waits_for_the_holder_without_spending_max_retries``
fails in every pool, with redis-py 5.3.0 and 6.4.0 alike), and Celery 5.5.x
cannot be installed with redis-py >= 5.3. The
newest are pinned, so that a new release cannot change a CI result
unannounced: bump them here.

Interpreters: ``pythonX.Y`` on PATH, or a pyenv install (``$PYENV_ROOT`` or
``~/.pyenv``). A missing interpreter is skipped with the reason printed, never
downloaded.
"""

from __future__ import annotations

import glob
import os
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]

LOWEST_CELERY, NEWEST_CELERY = "5.6.0", "5.7.0"
LOWEST_REDIS, NEWEST_REDIS = "5.3.0", "8.1.0"
# kombu 5.7 (which Celery 5.7 requires) declares redis>=6.4.0,<9 for its
# [redis] extra, so Celery 5.7 with redis-py 5.3 cannot be installed at all
# (pip: ResolutionImpossible). Its column runs with the lowest redis-py it
# accepts instead.
LOWEST_REDIS_FOR_CELERY_5_7 = "6.4.0"

# (celery, redis-py) per cell.
CELLS = [
    (LOWEST_CELERY, LOWEST_REDIS),
    (LOWEST_CELERY, NEWEST_REDIS),
    (NEWEST_CELERY, LOWEST_REDIS_FOR_CELERY_5_7),
    (NEWEST_CELERY, NEWEST_REDIS),
]
CELL_IDS = [f"celery{celery}-redis{redis}" for celery, redis in CELLS]
TESTS = ["tests/worker", "tests/unit", "tests/integration/test_tls.py"]
RESULTS = ROOT / ".nox" / "matrix.md"

# Left out below Celery 5.7, for Celery's faults, not this package's:
#
# Celery 5.6.0's embedded prefork worker (celery.contrib.testing) may not stop
# within its shutdown timeout after a task that raised, even a plain celery
# Task without this package ("Worker thread failed to exit within the
# allocated timeout": 1 of 3 tries with Celery 5.6.0 on Python 3.11 here, 0 of
# 6 with 5.7.0), and every embedded worker after it then fails to start. So
# every test that runs one is left out: the prefork-parametrized ones ("prefork"
# in their ids) and those that start a prefork worker themselves (listed by
# name; one hung the 3.11 celery 5.6.0 cell). The solo and threads variants
# of the parametrized ones still run.
#
# Celery < 5.7's Redis result backend can deadlock a thread that publishes
# while the garbage collector finalizes an AsyncResult (AsyncResult.__del__
# re-enters redis-py's PubSub lock; celery#10477, fixed in 5.7.0). It needs a
# publishing process that also consumes results: Celery's embedded test
# worker (celery.contrib.testing sets task_join_will_block False), not a
# threads or prefork `celery worker`, whose sends never subscribe. Seen here
# in the last two tests (a task thread re-sending itself, stuck in SUBSCRIBE
# -> AsyncResult.__del__ -> UNSUBSCRIBE; the pytest process then never exits)
# and, in the test's own main thread publishing a chord, in
# test_canvas_members_are_published_and_complete (3.12 cell; pytest-timeout's
# 120 s did not end it). Any test that publishes can hit it: leaving these
# out makes a Celery 5.6 cell less likely to hang, not sure not to; a hung
# cell has to be stopped by hand (kill its pytest process).
CELERY_5_6_DESELECTED = (
    "prefork",
    "test_abort_interrupts_a_blocking_body_in_the_main_thread",
    "test_soft_time_limit_releases",
    "test_the_worker_adopts_the_queued_lock",
    "test_a_redelivered_call_that_died_after_parking_runs_once",
    "test_p1_retry_is_delivered_not_swallowed",
    "test_p4_producer_and_worker_agree_on_the_key",
    "test_a_retry_with_other_arguments_does_not_hand_the_old_key",
    "test_retry_budget_spent_then_fallback",
)

nox.options.sessions = ["matrix"]
nox.options.download_python = "never"
# Skipped, with nox's "Python interpreter X not found", also when CI=true.
nox.options.error_on_missing_interpreters = False
nox.options.reuse_venv = "yes"

_pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
_pyenv_bins = sorted(glob.glob(os.path.join(_pyenv_root, "versions", "3.*", "bin")))
# pyenv's shims only answer for the versions selected with `pyenv global`;
# the installs' own bin directories have every pythonX.Y.
os.environ["PATH"] = os.pathsep.join([*_pyenv_bins, os.environ.get("PATH", "")])


def _run_cell(session: nox.Session, celery: str, redis: str, tests: list[str]) -> None:
    session.install(".[test]", f"celery[redis]=={celery}", f"redis=={redis}")
    versions = session.run(
        "python",
        "-c",
        "import sys, celery, kombu, redis; "
        "print(f'{sys.version.split()[0]} celery {celery.__version__} "
        "kombu {kombu.__version__} redis-py {redis.__version__}')",
        silent=True,
    )
    installed = str(versions).strip()
    session.log(f"installed: {installed}")
    selection = list(session.posargs or tests)
    if tuple(int(part) for part in celery.split(".")[:2]) < (5, 7):
        session.log(
            "Celery < 5.7: the embedded-prefork tests and the celery#10477-prone tests deselected"
        )
        selection += ["-k", " and ".join(f"not {name}" for name in CELERY_5_6_DESELECTED)]
    junit = ROOT / ".nox" / f"junit-{session.name.replace('/', '_')}.xml"
    started = time.monotonic()
    session.run(
        "python",
        "-m",
        "pytest",
        *selection,
        "-q",
        "-p",
        "no:cacheprovider",
        # One embedded worker that fails to stop leaves Celery's worker state
        # behind, and every later embedded worker then waits out the 120 s
        # test timeout: stop early instead of taking hours.
        "--maxfail=5",
        f"--junitxml={junit}",
        success_codes=[0, 1],
        env={"PYTHONDONTWRITEBYTECODE": "1"},
    )
    seconds = time.monotonic() - started
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {name: int(suite.get(name, 0)) for name in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    verdict = "passed" if counts["failures"] + counts["errors"] == 0 else "FAILED"
    row = (
        f"| {session.name} | {installed} | {verdict} | {passed} passed, "
        f"{counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped "
        f"| {seconds:.0f} s |"
    )
    RESULTS.parent.mkdir(exist_ok=True)
    if not RESULTS.exists():
        RESULTS.write_text("| Cell | Installed | Result | Tests | Time |\n|---|---|---|---|---|\n")
    with RESULTS.open("a") as out:
        out.write(row + "\n")
    session.log(row)
    if verdict != "passed":
        session.error(f"{counts['failures']} failed, {counts['errors']} errors")


@nox.session(python=PYTHONS)
@nox.parametrize(("celery", "redis"), CELLS, ids=CELL_IDS)
def matrix(session: nox.Session, celery: str, redis: str) -> None:
    """One cell of the whole matrix: the worker-level tests."""
    _run_cell(session, celery, redis, TESTS)


# The lowest bounds in CI run the tests that need no Celery result backend
# (unit, and the lock and store against a real redis-server: the redis-py
# side) plus the contention worker tests on the newest cells only: Celery
# 5.6's own result-backend deadlock (celery#10477) hung 2 of 4 full 5.6 cells
# here, and a hung cell would hold CI for its whole time budget. `make matrix`
# runs the worker tests on every cell.
LOWEST_CI_TESTS = [
    "tests/unit",
    "tests/integration/test_store.py",
    "tests/integration/test_redislock.py",
    "tests/integration/test_handoff_store.py",
    "tests/integration/test_limit_store.py",
]


@nox.session(python=None)
def lowest(session: nox.Session) -> None:
    """The lowest bounds (Celery 5.6.0, redis-py 5.3.0) on nox's own interpreter (CI subset)."""
    _run_cell(session, LOWEST_CELERY, LOWEST_REDIS, LOWEST_CI_TESTS)


# What CI runs besides `make test` (which covers the newest versions on the
# default interpreter): the lowest bounds on the default interpreter, and the
# newest versions on the oldest and newest Python found, with the unit tests
# and the contention worker tests, to stay within minutes.
CI_TESTS = ["tests/unit", "tests/worker/test_contention.py"]


@nox.session(python=[PYTHONS[0], PYTHONS[-1]])
def newest_other_pythons(session: nox.Session) -> None:
    """The newest Celery and redis-py on the oldest and newest Python (CI subset)."""
    _run_cell(session, NEWEST_CELERY, NEWEST_REDIS, CI_TESTS)


@nox.session(python=False)
def matrix_ci(session: nox.Session) -> None:
    """The bounded subset for .ci/run: the sessions above, in this nox process."""
    session.notify("lowest")
    for python in (PYTHONS[0], PYTHONS[-1]):
        session.notify(f"newest_other_pythons-{python}")
