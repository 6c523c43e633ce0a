"""One version: pyproject.toml's is the installed one and ``celery_redislock.__version__``."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import celery_redislock

ROOT = Path(__file__).resolve().parent.parent.parent


def test_version_agrees_with_pyproject_and_the_changelog() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    (declared,) = re.findall(r'^version = "([^"]+)"$', pyproject, flags=re.MULTILINE)
    assert celery_redislock.__version__ == declared == metadata.version("celery-redislock"), (
        "reinstall the package (make .venv/bin/.installed-test) after changing the version"
    )
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    # A release moves "Unreleased" under a heading of the version it bumps to.
    released = re.findall(r"^## \[(\d[^\]]*)\]", changelog, flags=re.MULTILINE)
    if released:
        assert released[0] == declared
