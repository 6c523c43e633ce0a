"""One job per module: no import circles, and the lower layers never import Celery.

The import graph is read from the source (``ast``), counting only imports
that run when the module is imported: an import under ``if TYPE_CHECKING:``
is for the type checker and runs never. A ``from celery_redislock import X``
where ``X`` is a submodule is an edge to that submodule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import celery_redislock

PACKAGE = Path(celery_redislock.__file__).parent

#: Modules below the Celery wiring: keys, values, scripts, Redis I/O. They
#: must work (and be testable) without Celery.
LOWER_LAYERS = {
    "celery_redislock._clock",
    "celery_redislock._process",
    "celery_redislock.aiostore",
    "celery_redislock.clients",
    "celery_redislock.exceptions",
    "celery_redislock.keys",
    "celery_redislock.park_scripts",
    "celery_redislock.pending",
    "celery_redislock.pending_scripts",
    "celery_redislock.protocol",
    "celery_redislock.scripts",
    "celery_redislock.store",
    "celery_redislock.tokens",
    "celery_redislock.transport",
    "celery_redislock.urls",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    if not name.startswith("celery_redislock."):
        return False
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").exists() or (PACKAGE / relative).is_dir()


def runtime_imports(path: Path) -> set[str]:
    """Modules imported when ``path`` is imported (TYPE_CHECKING blocks left out)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                # ``from pkg import sub`` needs only the submodule when ``sub``
                # is one (the parent package is always imported first anyway).
                names = [f"{node.module}.{alias.name}" for alias in node.names]
                submodules = [name for name in names if _is_module(name)]
                found.update(submodules)
                if len(submodules) < len(names):
                    found.add(node.module)
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    visit([child for child in children if isinstance(child, ast.stmt)])
            if isinstance(node, ast.ExceptHandler):
                visit(node.body)

    visit(tree.body)
    return found


def package_graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = {imported for imported in runtime_imports(path) if imported in modules}
        graph[name] = edges - {name}
    return graph


def test_no_module_imports_another_in_a_circle() -> None:
    graph = package_graph()
    # The package's __init__ re-exports; a submodule importing a *name* from
    # the package itself would close a circle through it.
    state: dict[str, int] = {}
    path: list[str] = []
    cycles: list[list[str]] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)
    assert cycles == []


def test_the_lower_layers_never_import_celery() -> None:
    graph = package_graph()
    for name in sorted(LOWER_LAYERS & graph.keys()):
        imported = runtime_imports(PACKAGE.parent / (name.replace(".", "/") + ".py"))
        celery = sorted(m for m in imported if m == "celery" or m.startswith(("celery.", "kombu")))
        assert celery == [], f"{name} imports {celery}"
        upper = sorted(graph[name] - LOWER_LAYERS)
        assert upper == [], f"{name} imports the upper layers {upper}"


def test_every_module_opens_with_a_docstring_saying_its_job() -> None:
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and len(doc.split()) >= 4, f"{module_name(path)} has no docstring"
