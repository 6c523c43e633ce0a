"""The README's code blocks, for the tests that keep it honest.

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

README = Path(__file__).resolve().parent.parent / "README.md"

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

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"


def blocks(text: str | None = None) -> list[Block]:
    text = README.read_text() if text is None else text
    return [
        Block(
            language=match["language"],
            body=match["body"],
            marker=(match["marker"] or "").strip(),
            line=text.count("\n", 0, match.start("body")),
        )
        for match in _BLOCK.finditer(text)
    ]


def python_blocks() -> list[Block]:
    return [block for block in blocks() if block.language == "python"]
