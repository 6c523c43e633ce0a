"""Griffe extension: the docstrings' Sphinx roles as Markdown, for mkdocstrings.

The package's docstrings use reST roles (``:class:`~celery_redislock.x.Y```).
A fully qualified public target becomes a cross-reference (``[`Y`][...]``),
which mkdocs-autorefs resolves, and which fails the strict build when the
target is renamed or removed; any other target (relative, private, outside
the package) becomes inline code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _replace(match: re.Match[str]) -> str:
    short, target = match.group(1) == "~", match.group(2).strip()
    shown = target.rsplit(".", 1)[-1] if short else target
    if target.endswith("()"):
        target = target[:-2]
    public = target.startswith("celery_redislock.") and not any(
        part.startswith("_") for part in target.split(".")
    )
    return f"[`{shown}`][{target}]" if public else f"`{shown}`"


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring's Sphinx roles when griffe loads an object."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Convert the roles in ``obj``'s docstring."""
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_replace, obj.docstring.value)
