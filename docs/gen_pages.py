"""Generate the documentation pages (run by mkdocs-gen-files during `mkdocs build`).

One source for everything:

* prose pages are the README's sections (the README is the contract the
  acceptance tests read), placed on pages by ``PAGES``; links between
  sections are rewritten to the page that now holds the target heading;
* the settings reference is built from ``celery_redislock.settings``;
* the CLI reference from the click command (the ``mkdocs-click`` directive);
* the API reference from the docstrings (``mkdocstrings`` directives).

A README section that no page places fails the build, so a new section
cannot silently go missing from the site.
"""

from __future__ import annotations

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
        "Getting started",
        [
            "",  # the text before the first "## " heading
            "Install",
            "Quickstart",
            "Configuration",
            "Django",
            "Examples and demo",
            "Similar projects",
        ],
    ),
    "guarantees.md": (
        "Guarantees and failure modes",
        ["Where the lock is released", "Guarantees and failure modes"],
    ),
    "policies.md": (
        "Policies",
        [
            "When the lock is held: policies",
            "part:timelines.md",
            "Deduplicating at enqueue time (transaction callbacks, webhooks)",
            "Periodic jobs that must not overlap (beat)",
            "Debounce and throttle",
            "At most N per key",
        ],
    ),
    "settings.md": ("Settings reference", ["gen:settings"]),
    "cli.md": ("CLI reference", ["Operating it: `celery redislock`", "gen:cli"]),
    "topologies.md": ("Redis topologies", ["Redis topologies: Sentinel, Cluster, TLS, ACL"]),
    "observability.md": (
        "Observability",
        ["Signals and logging", "Exceptions", "Metrics (Prometheus)", "Flower"],
    ),
    "design.md": ("How it works", ["How it works", "Standalone lock", "Reference"]),
    "benchmarks.md": ("Benchmarks", ["Benchmarks", "gen:bench-results"]),
    "tests.md": ("Tests", ["Tests"]),
}

# README sections deliberately left off the site (navigation of the README itself).
SKIPPED_SECTIONS = {"Contents", "Table of contents"}

# page -> [(title, module)]: one mkdocstrings block per module.
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
    "reference/settings.md": ("Settings module", ["celery_redislock.settings"]),
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
            "celery_redislock.headers",
            "celery_redislock.keys",
            "celery_redislock.tokens",
            "celery_redislock.scripts",
            "celery_redislock.transport",
            "celery_redislock.clients",
            "celery_redislock.urls",
            "celery_redislock.renewer",
            "celery_redislock.abort",
            "celery_redislock.takeback",
            "celery_redislock.handoff",
            "celery_redislock.owners",
            "celery_redislock.startup",
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
    """The settings reference, built from ``celery_redislock.settings.SETTINGS``."""
    from celery_redislock import settings

    lines = [
        "Generated from `celery_redislock.settings.SETTINGS`, the one registry the",
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
    public = set(getattr(settings, "__all__", ()))
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
            target = f"celery_redislock.settings.{validator}"
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


def build() -> None:
    """Write every page into the virtual docs directory."""
    sections = readme_sections()
    placed = {item for _, items in PAGES.values() for item in items}
    unplaced = set(sections) - placed - SKIPPED_SECTIONS
    if unplaced:
        raise SystemExit(f"docs/gen_pages.py: README sections on no page: {sorted(unplaced)}")

    generated = {"gen:settings": settings_page(), "gen:cli": CLI_DIRECTIVE}
    generated["gen:bench-results"] = bench_results()
    bodies: dict[str, list[str]] = {}
    anchor_page: dict[str, tuple[str, str]] = {}  # github slug -> (page, toc slug)
    for page, (_title, items) in PAGES.items():
        parts = []
        for item in items:
            if item.startswith("part:"):
                parts.append((PARTS / item[5:]).read_text())
            elif item.startswith("gen:"):
                parts.append(generated[item])
            else:
                if item not in sections:
                    raise SystemExit(f"docs/gen_pages.py: no README section {item!r}")
                parts.append(sections[item])
        bodies[page] = parts
        for heading in headings("\n".join(parts)):
            anchor_page.setdefault(github_slug(heading), (page, toc_slug(heading)))

    def relink(page: str, text: str) -> str:
        def replace(match: re.Match[str]) -> str:
            target = anchor_page.get(match.group(1))
            if target is None:
                return match.group(0)  # left for mkdocs' anchor check to report
            where, slug = target
            return f"]({'' if where == page else where}#{slug})"

        return re.sub(r"\]\(#([^)]+)\)", replace, text)

    for page, (title, items) in PAGES.items():
        text = "\n\n".join(bodies[page]).strip() + "\n"
        # A page opening with a README section takes that section's heading as its title.
        text = text[1:] if items[0] in sections and items[0] else f"# {title}\n\n" + text
        with mkdocs_gen_files.open(page, "w") as out:
            out.write(relink(page, text))

    for page, (title, modules) in REFERENCE.items():
        with mkdocs_gen_files.open(page, "w") as out:
            out.write(f"# {title}\n\n")
            for module in modules:
                out.write(f"::: {module}\n\n")


build()
