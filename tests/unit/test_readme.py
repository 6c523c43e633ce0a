"""The README's code blocks compile, their markers are known, and its links find their sections.

The same holds for the reference parts moved out of the README into
docs/_parts/*.md (the docs site's pages are built from both). The quickstart
itself runs end to end in tests/processes/test_readme_quickstart.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.readme import PARTS, README, ROOT, Block, blocks, part_files, python_blocks

PYTHON_BLOCKS = python_blocks()
PART_PYTHON_BLOCKS = [
    block for part in part_files() for block in blocks(source=part) if block.language == "python"
]
DOCUMENTS = [README, *part_files()]


@pytest.mark.parametrize(
    "block",
    PYTHON_BLOCKS + PART_PYTHON_BLOCKS,
    ids=[block.where for block in PYTHON_BLOCKS + PART_PYTHON_BLOCKS],
)
def test_every_python_block_compiles(block: Block) -> None:
    compile(block.body, block.where, "exec")


def test_the_parts_hold_code_blocks_and_only_fragments() -> None:
    # The moved reference parts are compiled above; only the README's
    # quickstart is run, so a part has no runnable block, file or worker command.
    assert len(part_files()) >= 8
    assert PART_PYTHON_BLOCKS, "no python block found in docs/_parts"
    for part in part_files():
        for block in blocks(source=part):
            assert block.marker in ("", "fragment"), f"{block.where}: marker {block.marker!r}"
            if block.language == "python":
                assert block.marker == "fragment", f"{block.where}: runs nowhere, mark it"


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


def _headings(path: Path) -> set[str]:
    prose = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {_anchor(heading) for heading in re.findall(r"^#{1,6} (.+)$", prose, re.MULTILINE)}


@pytest.mark.parametrize("document", DOCUMENTS, ids=[str(d.relative_to(ROOT)) for d in DOCUMENTS])
def test_every_link_to_a_file_or_a_heading_in_one_finds_it(document: Path) -> None:
    # Read on GitHub, the README links into docs/_parts/ and the parts link
    # back (../../README.md#...) and to each other: each target must exist.
    prose = re.sub(r"^```.*?^```$", "", document.read_text(), flags=re.MULTILINE | re.DOTALL)
    broken = []
    for path, anchor in re.findall(r"\]\(([^)\s#]*)(?:#([^)\s]*))?\)", prose):
        if "://" in path:
            continue
        target = (document.parent / path).resolve() if path else document
        if not target.exists():
            broken.append(f"{path}: no such file")
        elif anchor and anchor not in _headings(target):
            broken.append(f"{path}#{anchor}: no such heading")
    assert broken == []


def test_the_readme_links_to_every_moved_part() -> None:
    linked = set(re.findall(r"\]\(docs/_parts/([\w-]+\.md)", README.read_text()))
    # timelines.md was written for the docs site only (its policies page).
    assert {part.name for part in part_files()} - linked == {"timelines.md"}
    assert (PARTS / "timelines.md").exists()


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
