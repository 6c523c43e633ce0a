"""Generate the documentation pages (run by mkdocs-gen-files during `mkdocs build`).

One source for everything:

* prose pages are the README's sections (the README is the contract the
  acceptance tests read) and the Markdown files in ``docs/_parts/`` (the
  reference parts moved out of the README, which links to them), placed on
  pages by ``PAGES``; links between them (``#anchor`` within a file,
  ``docs/_parts/x.md#anchor`` from the README, ``x.md#anchor`` or
  ``../../README.md#anchor`` from a part) are rewritten to the page that
  now holds the target heading;
* the settings reference is built from ``celery_redislock.settings``;
* the CLI reference from the click command (the ``mkdocs-click`` directive);
* the API reference from the docstrings (``mkdocstrings`` directives).

A README section or a part that no page places fails the build, so a new
section cannot silently go missing from the site; a link to a heading that
no page holds is left as it is, for mkdocs' strict link check to fail.
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path
from typing import Any

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parent.parent
PARTS = ROOT / "docs" / "_parts"

# page -> (title, [README "## " section titles or "part:<file>" or "gen:<name>"])
PAGES: dict[str, tuple[str, list[str]]] = {
    "index.md": (
        # The landing page: the package's name over the README's opening (the
        # nav still says "Getting started", mkdocs.yml).
        "celery-redislock",
        [
            "",  # the text before the first "## " heading
            "Install",
            "Quickstart",
            "Configuration",
            "part:configuration.md",
            "Examples and demo",
            "Similar projects",
        ],
    ),
    "guarantees.md": (
        "Guarantees and failure modes",
        [
            "Guarantees and failure modes",
            "part:release.md",
            "part:parent-release.md",
            "part:failure-modes.md",
        ],
    ),
    "policies.md": (
        "Policies",
        [
            "When the lock is held: policies",
            "part:policies.md",
            "part:handoff.md",
            "part:timelines.md",
            "Deduplicating at enqueue time (transaction callbacks, webhooks)",
            "part:enqueue.md",
            "part:enqueue-unreachable.md",
            "Periodic jobs that must not overlap (beat)",
            "Debounce, at most N per key, Django",
            "part:debounce.md",
            "part:limit.md",
            "part:django.md",
        ],
    ),
    "settings.md": ("Settings reference", ["gen:settings"]),
    "cli.md": ("CLI reference", ["part:cli.md", "gen:cli"]),
    "topologies.md": ("Redis topologies", ["part:topologies.md"]),
    "brokers.md": ("Brokers", ["part:brokers.md"]),
    "observability.md": ("Observability", ["part:observability.md"]),
    "design.md": (
        "How it works",
        ["part:how-it-works.md", "part:standalone-lock.md", "part:reference.md"],
    ),
    "benchmarks.md": ("Benchmarks", ["Benchmarks", "part:benchmarks.md", "gen:bench-results"]),
    "tests.md": ("Tests", ["Tests", "part:tests.md"]),
}

# README sections deliberately left off the site: the README's own navigation
# (its contents, and the list of links to the parts, which the site has as pages).
SKIPPED_SECTIONS = {"Contents", "Table of contents", "Reference documentation"}

# page -> [(title, module)]: one mkdocstrings block per module.
# Classes composed from the package's own bases (LockStore from the store_*
# modules, the handles from leasing.Lease, the locks from standalone) show
# their inherited members on these pages.
INHERITED = {
    "celery_redislock.store",
    "celery_redislock.lease",
    "celery_redislock.lock",
    "celery_redislock.aiolock",
    "celery_redislock.aiostore",
}
REFERENCE: dict[str, tuple[str, list[str]]] = {
    "reference/package.md": ("The package", ["celery_redislock"]),
    "reference/task.md": (
        "Task",
        ["celery_redislock.task", "celery_redislock.request", "celery_redislock.lease"],
    ),
    "reference/policies.md": ("Policies", ["celery_redislock.policies"]),
    "reference/lock.md": (
        "Standalone lock",
        ["celery_redislock.lock", "celery_redislock.aiolock", "celery_redislock.aiostore"],
    ),
    "reference/store.md": ("Lock store", ["celery_redislock.store"]),
    "reference/settings.md": (
        "Settings module",
        [
            "celery_redislock.settings",
            "celery_redislock.setting_specs",
            "celery_redislock.setting_checks",
            "celery_redislock.validators",
        ],
    ),
    "reference/exceptions.md": ("Exceptions", ["celery_redislock.exceptions"]),
    "reference/signals.md": ("Signals", ["celery_redislock.signals"]),
    "reference/fencing.md": ("Fencing", ["celery_redislock.fencing"]),
    "reference/admin.md": ("Admin", ["celery_redislock.admin", "celery_redislock.cli"]),
    "reference/contrib.md": (
        "Contrib",
        ["celery_redislock.contrib.prometheus", "celery_redislock.contrib.django"],
    ),
    "reference/internals.md": (
        "Internals",
        [
            "celery_redislock.enqueue",
            "celery_redislock.execution",
            "celery_redislock.acquire",
            "celery_redislock.parking",
            "celery_redislock.resend",
            "celery_redislock.task_shape",
            "celery_redislock.brokers",
            "celery_redislock.headers",
            "celery_redislock.keys",
            "celery_redislock.tokens",
            "celery_redislock.scripts",
            "celery_redislock.transport",
            "celery_redislock.clients",
            "celery_redislock.urls",
            "celery_redislock.renewer",
            "celery_redislock.leasing",
            "celery_redislock.standalone",
            "celery_redislock.outcomes",
            "celery_redislock.protocol",
            "celery_redislock.resp",
            "celery_redislock.aiotransport",
            "celery_redislock.aiolease",
            "celery_redislock.aiorenewer",
            "celery_redislock.abort",
            "celery_redislock.takeback",
            "celery_redislock.handoff",
            "celery_redislock.owners",
            "celery_redislock.startup",
            "celery_redislock.revoked",
            "celery_redislock.recovery",
        ],
    ),
}


def toc_slug(text: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (its default slugify)."""
    text = re.sub(r"`([^`]*)`", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def github_slug(text: str) -> str:
    """The anchor GitHub gives a README heading (the README's own links use these)."""
    text = re.sub(r"`([^`]*)`", r"\1", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def readme_sections() -> dict[str, str]:
    """The README split at its "## " headings: title -> text (heading included)."""
    sections: dict[str, str] = {}
    title = ""
    lines: list[str] = []
    in_fence = False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        if not in_fence and line.startswith("## "):
            sections[title] = "\n".join(lines)
            title, lines = line[3:].strip(), []
        lines.append(line)
    sections[title] = "\n".join(lines)
    # The README's own title is the site's name; the page has its own heading.
    sections[""] = re.sub(r"\A# .*\n", "", sections[""])
    return sections


def headings(text: str) -> list[str]:
    """Markdown headings of ``text`` outside code fences."""
    found, in_fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and re.match(r"#{1,6} ", line):
            found.append(line.lstrip("#").strip())
    return found


def settings_page() -> str:
    """The settings reference, built from ``celery_redislock.setting_specs.SETTINGS``."""
    from celery_redislock import settings, validators

    lines = [
        "Generated from `celery_redislock.setting_specs.SETTINGS`, the one registry the",
        "package reads, validates and documents its settings from. Settings are read",
        'from `app.conf`; under `config_from_object(..., namespace="CELERY")` the',
        "`CELERY_REDISLOCK_*` spelling works too. A task attribute left at `None`",
        "inherits the app setting.",
        "",
        "| App setting | Task attribute | Default |",
        "|---|---|---|",
    ]
    specs: Any = getattr(settings, "SETTINGS", None)
    if specs is None:
        raise SystemExit("docs/gen_pages.py: celery_redislock.settings has no SETTINGS registry")
    public = set(getattr(validators, "__all__", ()))
    for spec in specs:
        attribute = f"`{spec.task_attribute}`" if spec.task_attribute else "—"
        default = getattr(spec, "shown_default", f"`{spec.default!r}`")
        lines.append(f"| [`{spec.name}`](#{toc_slug(spec.name)}) | {attribute} | {default} |")
    lines.append("")
    for spec in specs:
        default = getattr(spec, "shown_default", f"`{spec.default!r}`")
        lines += [f"## {spec.name}", "", spec.doc, ""]
        if spec.task_attribute:
            lines.append(f"* Task attribute: `{spec.task_attribute}`")
        lines.append(f"* Default: {default}")
        validator = getattr(spec.validate, "__name__", "")
        if validator in public:
            # A cross-reference: renaming the validator breaks the strict build.
            target = f"celery_redislock.validators.{validator}"
            lines.append(f"* Checked by [`{validator}`][{target}]")
        lines.append("")
    return "\n".join(lines)


CLI_DIRECTIVE = """\
## Commands

Generated from the click command `celery_redislock.cli:redislock`.

::: mkdocs-click
    :module: celery_redislock.cli
    :command: redislock
    :prog_name: celery -A proj redislock
    :depth: 1
    :style: plain
"""


def bench_results() -> str:
    """``bench/results/results.md``, its headings moved below the page's."""
    text = (ROOT / "bench" / "results" / "results.md").read_text()
    # Its own headings go one level down, below the page's "## " sections.
    text = re.sub(r"^(#{1,5}) ", r"#\1 ", text, flags=re.MULTILINE)
    return text.replace(
        "## Benchmark results", "## The committed run (`bench/results/results.md`)", 1
    )


README = ROOT / "README.md"

# A Markdown link's target: "(path#anchor)", "(path)" or "(#anchor)".
_LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]*))?\)")


def build() -> None:
    """Write every page into the virtual docs directory."""
    sections = readme_sections()
    items_placed = [item for _, items in PAGES.values() for item in items]
    placed = set(items_placed)
    unplaced = set(sections) - placed - SKIPPED_SECTIONS
    if unplaced:
        raise SystemExit(f"docs/gen_pages.py: README sections on no page: {sorted(unplaced)}")
    parts_on_disk = {f"part:{path.name}" for path in PARTS.glob("*.md")}
    if parts_on_disk - placed:
        raise SystemExit(f"docs/gen_pages.py: parts on no page: {sorted(parts_on_disk - placed)}")
    twice = {item for item in items_placed if item.startswith("part:")}
    twice = {item for item in twice if items_placed.count(item) > 1}
    if twice:
        raise SystemExit(f"docs/gen_pages.py: parts on more than one page: {sorted(twice)}")

    generated = {"gen:settings": settings_page(), "gen:cli": CLI_DIRECTIVE}
    generated["gen:bench-results"] = bench_results()
    # page -> [(source file or None for generated text, text)]
    chunks: dict[str, list[tuple[Path | None, str]]] = {}
    # (source file, github slug) -> (page, toc slug); (part file, "") -> its page and first heading
    anchors: dict[tuple[Path, str], tuple[str, str]] = {}
    for page, (_title, items) in PAGES.items():
        page_chunks: list[tuple[Path | None, str]] = []
        for item in items:
            source: Path | None
            if item.startswith("part:"):
                source = PARTS / item[5:]
                text = source.read_text()
            elif item.startswith("gen:"):
                source, text = None, generated[item]
            else:
                if item not in sections:
                    raise SystemExit(f"docs/gen_pages.py: no README section {item!r}")
                source, text = README, sections[item]
            page_chunks.append((source, text))
            if source is None:
                continue
            found = headings(text)
            if source != README and found:
                anchors[(source, "")] = (page, toc_slug(found[0]))
            for heading in found:
                anchors.setdefault((source, github_slug(heading)), (page, toc_slug(heading)))
        chunks[page] = page_chunks

    def relink(page: str, source: Path, text: str) -> str:
        """Point the links of ``text`` (from ``source``) at the pages holding their targets."""

        def replace(match: re.Match[str]) -> str:
            path, anchor = match.group(1), match.group(2) or ""
            if "://" in path or path.startswith("mailto:"):
                return match.group(0)
            target_file = Path(os.path.normpath(source.parent / path)) if path else source
            target = anchors.get((target_file, anchor))
            if target is None:
                return match.group(0)  # left for mkdocs' link check to report
            where, slug = target
            return f"]({'' if where == page else where}#{slug})"

        return _LINK.sub(replace, text)

    for page, (title, _items) in PAGES.items():
        text = (
            "\n\n".join(
                text if source is None else relink(page, source, text)
                for source, text in chunks[page]
            ).strip()
            + "\n"
        )
        # A page opening with a section's heading takes that heading as its title.
        text = text[1:] if text.startswith("## ") else f"# {title}\n\n" + text
        with mkdocs_gen_files.open(page, "w") as out:
            out.write(text)

    for page, (title, modules) in REFERENCE.items():
        with mkdocs_gen_files.open(page, "w") as out:
            out.write(f"# {title}\n\n")
            for module in modules:
                out.write(f"::: {module}\n")
                if module in INHERITED:
                    out.write("    options:\n      inherited_members: true\n")
                out.write("\n")


build()
