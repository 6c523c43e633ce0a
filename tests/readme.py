"""The README's code blocks, for the tests that keep it honest.

The reference parts moved out of the README (``docs/_parts/*.md``, pages of
the docs site) are read the same way: ``blocks(source=part)``.

A fenced block may follow an HTML comment that says what it is:

* ``<!-- fragment -->``: a piece of a larger program; only compiled.
* ``<!-- file: NAME -->``: a file the reader saves as NAME; compiled, and
  written out before the runnable blocks run.
* ``<!-- worker -->``: the shell command that starts the worker.

Every other ``python`` block is runnable: the quickstart test runs each one
in order, next to the files and with the worker started.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PARTS = ROOT / "docs" / "_parts"

_BLOCK = re.compile(
    r"(?:<!--\s*(?P<marker>[^>]*?)\s*-->\n)?^```(?P<language>[\w-]*)\n(?P<body>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)


@dataclass(frozen=True)
class Block:
    language: str
    body: str
    marker: str  # "" when unmarked
    line: int
    source: Path = README

    @property
    def where(self) -> str:
        return f"{self.source.relative_to(ROOT)}:{self.line}"


def blocks(text: str | None = None, source: Path = README) -> list[Block]:
    text = source.read_text() if text is None else text
    return [
        Block(
            language=match["language"],
            body=match["body"],
            marker=(match["marker"] or "").strip(),
            line=text.count("\n", 0, match.start("body")),
            source=source,
        )
        for match in _BLOCK.finditer(text)
    ]


def part_files() -> list[Path]:
    """The Markdown parts of the docs site, in name order."""
    return sorted(PARTS.glob("*.md"))


def python_blocks() -> list[Block]:
    return [block for block in blocks() if block.language == "python"]
