"""The README's quickstart, run as a reader would: save the file, start the worker, run the call.

The blocks come from README.md (see tests/readme.py), so the README cannot
drift from what works. ``REDIS_URL`` points them at the test's own server.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.brokers import redis_broker_only
from tests.readme import blocks
from tests.servers import RedisServer, wait_until

pytestmark = [
    pytest.mark.subprocess,
    redis_broker_only("the README's quickstart is written for the Redis broker (REDIS_URL)"),
]


def test_quickstart_runs_end_to_end(server: RedisServer, tmp_path: Path) -> None:
    readme_blocks = blocks()
    for block in readme_blocks:
        if block.language == "python" and block.marker.startswith("file: "):
            (tmp_path / block.marker.removeprefix("file: ")).write_text(block.body)
    (worker_block,) = [block for block in readme_blocks if block.marker == "worker"]
    runnable = [block for block in readme_blocks if block.language == "python" and not block.marker]

    env = {**os.environ, "REDIS_URL": server.url}
    env.pop("PYTHONPATH", None)  # only what a reader has: the installed package and cwd
    command = shlex.split(worker_block.body.strip())
    assert command[0] == "celery"
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", *command],  # the command as the README gives it
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        def ready() -> bool:
            assert worker.poll() is None, log_path.read_text()
            return "ready." in log_path.read_text()

        wait_until(ready, timeout=60, interval=0.1, message="the quickstart worker to be ready")
        assert f"lock store {server.url}/2 answers" in log_path.read_text()
        for block in runnable:
            done = subprocess.run(
                [sys.executable, "-c", block.body],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=90,
            )
            assert done.returncode == 0, f"{block.where}:\n{done.stderr}\n{log_path.read_text()}"
        assert done.stdout.strip().endswith("ok")
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            # Prefork children are in the worker's process group only if it made one:
            # kill the ones it left by their parent id.
            children = subprocess.run(
                ["ps", "-o", "pid=", "--ppid", str(worker.pid)], capture_output=True, text=True
            ).stdout.split()
            for child in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(child), signal.SIGKILL)
            worker.kill()
            worker.wait(5)
