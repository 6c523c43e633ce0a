"""The README's code blocks compile, their markers are known, and its links find their sections.

The quickstart itself runs end to end in tests/processes/test_readme_quickstart.py.
"""

from __future__ import annotations

import re

import pytest

from tests.readme import README, Block, blocks, python_blocks

PYTHON_BLOCKS = python_blocks()


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[block.where for block in PYTHON_BLOCKS])
def test_every_python_block_compiles(block: Block) -> None:
    compile(block.body, block.where, "exec")


def test_markers_are_known_and_the_quickstart_is_complete() -> None:
    all_blocks = blocks()
    for block in all_blocks:
        assert block.marker in ("", "fragment", "worker") or block.marker.startswith("file: "), (
            f"{block.where}: unknown marker {block.marker!r}"
        )
    files = [block for block in PYTHON_BLOCKS if block.marker.startswith("file: ")]
    runnable = [block for block in PYTHON_BLOCKS if not block.marker]
    workers = [block for block in all_blocks if block.marker == "worker"]
    assert [block.marker for block in files] == ["file: proj.py"]
    assert len(runnable) == 1
    assert len(workers) == 1
    assert workers[0].body.startswith("celery -A proj worker")
    # The quickstart sets a result backend (its calls use result.get()).
    assert "backend=" in files[0].body
    assert "redislock_url" in files[0].body


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_link_to_a_section_finds_it_and_every_section_is_listed() -> None:
    text = README.read_text()
    # Headings inside code blocks are not headings.
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^##+ (.+)$", prose, flags=re.MULTILINE)
    anchors = {_anchor(heading) for heading in headings}
    links = set(re.findall(r"\]\(#([^)]+)\)", prose))
    assert links - anchors == set(), "links to sections that do not exist"
    contents = prose.split("## Contents", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"\]\(#([^)]+)\)", contents))
    top_level = {_anchor(heading) for heading in re.findall(r"^## (.+)$", prose, re.MULTILINE)}
    assert top_level - listed - {"contents"} == set(), "sections missing from the contents"


def test_install_gives_the_lines_that_work_today() -> None:
    install = README.read_text().split("## Install\n", 1)[1].split("\n## ", 1)[0]
    assert "pip install .  " in install
    assert 'pip install "git+https://<your-git-host>/<org>/celery-redislock"' in install
    assert "pip install celery-redislock " in install
    assert "not on PyPI yet" in install


def test_settings_named_in_readme_tables_exist() -> None:
    from celery_redislock.settings import SETTINGS_BY_NAME

    rows = re.findall(r"^\| `(redislock_\w+)` \|", README.read_text(), flags=re.MULTILINE)
    assert rows, "no settings table found"
    assert set(rows) - set(SETTINGS_BY_NAME) == set()
