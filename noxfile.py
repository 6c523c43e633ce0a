"""Compatibility matrix: Python x Celery x redis-py, running the worker-level tests.

``make matrix`` (``nox -s matrix``) runs every cell; ``make matrix-ci``
(``nox -s matrix_ci``) the bounded subset CI runs. Each cell gets its own
virtualenv under ``.nox/``, installs the package with its test extra and the
cell's exact Celery and redis-py versions, and runs ``tests/worker`` and
``tests/unit`` and the TLS test (real ``redis-server`` processes, embedded
workers, a real Flower). Each cell appends one row (installed versions, test
counts, seconds) to ``.nox/matrix.md``.

The bounds, as ``pyproject.toml`` states them: ``celery[redis]>=5.7``,
``redis>=6.4``, Python >= 3.10; the lowest cell pins exactly those (5.7.0,
6.4.0) and pip picks the rest that fit, as it would for a user pinning these
two. The newest are pinned, so that a new release cannot change a CI result
unannounced: bump them here.

Celery's bound was raised twice by this matrix. From 5.3 to 5.6: Celery 5.3.0
and 5.4.0 lost the lock-retry budget header of the re-sent message
(``test_retry_waits_for_the_holder_without_spending_max_retries`` fails in
every pool, with redis-py 5.3.0 and 6.4.0 alike), and Celery 5.5.x cannot be
installed with redis-py >= 5.3. From 5.6 to 5.7: the Celery 5.6.0 cells with
redis-py 5.3.0 failed on Python 3.10, 3.12 and 3.13, and two 5.6.0 cells
hung, even with the tests that hit its own bugs left out. Celery 5.6's Redis result backend
can deadlock a thread that publishes while the garbage collector finalizes an
``AsyncResult`` (``AsyncResult.__del__`` re-enters redis-py's PubSub lock;
celery#10477, fixed in 5.7.0): the hangs, the 3.10 failure and the canvas
test's on 3.12. Its embedded prefork test worker may not stop after a task
that raised (1 of 3 tries, with plain Celery tasks too), so the 5.6 cells had
to leave out every test that starts one. The 3.13 failure was not explained.
Celery 5.7 requires kombu 5.7, whose ``[redis]`` extra requires redis-py >=
6.4: that is redis-py's bound.

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

LOWEST_CELERY, NEWEST_CELERY = "5.7.0", "5.7.0"
LOWEST_REDIS, NEWEST_REDIS = "6.4.0", "8.1.0"

# (celery, redis-py) per cell: only Celery 5.7 is supported (see above), so
# the cells differ in redis-py.
CELLS = [
    (LOWEST_CELERY, LOWEST_REDIS),
    (NEWEST_CELERY, NEWEST_REDIS),
]
CELL_IDS = [f"celery{celery}-redis{redis}" for celery, redis in CELLS]
TESTS = ["tests/worker", "tests/unit", "tests/integration/test_tls.py"]
RESULTS = ROOT / ".nox" / "matrix.md"

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
        # In 3 processes, as `make test` runs the suite.
        "-n",
        "3",
        # A cell that goes wrong (a dependency's own bug) stops early instead
        # of waiting out the 120 s test timeout test after test.
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


# The lowest bounds in CI: the unit tests, the lock and store against a real
# redis-server (the redis-py side) and the contention worker tests.
LOWEST_CI_TESTS = [
    "tests/unit",
    "tests/integration/test_store.py",
    "tests/integration/test_redislock.py",
    "tests/integration/test_handoff_store.py",
    "tests/integration/test_limit_store.py",
    "tests/worker/test_contention.py",
]


@nox.session(python=None)
def lowest(session: nox.Session) -> None:
    """The lowest bounds (Celery 5.7.0, redis-py 6.4.0) on nox's own interpreter (CI subset)."""
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
