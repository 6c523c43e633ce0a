"""One job per module: small modules, no import circles, the lower layers never import Celery.

The import graph is read from the source (``ast``). The runtime graph
counts only imports that run when the module is imported (an import under
``if TYPE_CHECKING:`` runs never); the whole graph counts every import,
type-only and function-level ones included, since a circle there is still
two modules that each need the other. A ``from celery_redislock import X``
where ``X`` is a submodule is an edge to that submodule.

Sizes: no module over 450 lines, no class over 300, ``task.py`` at most
300. Modules and classes over it when the rule came stand in ``OVER_LIMIT``
and ``CLASSES_OVER_LIMIT`` with their size then: a ratchet, they may shrink
but not grow, and leave the list once under the limit.
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
    "celery_redislock.aiotransport",
    "celery_redislock.clients",
    "celery_redislock.evalsha",
    "celery_redislock.exceptions",
    "celery_redislock.key_family",
    "celery_redislock.keys",
    "celery_redislock.outcomes",
    "celery_redislock.park_scripts",
    "celery_redislock.slot_scripts",
    "celery_redislock.pending",
    "celery_redislock.pending_scripts",
    "celery_redislock.debounce_scripts",
    "celery_redislock.protocol",
    "celery_redislock.resp",
    "celery_redislock.scripts",
    "celery_redislock.store",
    "celery_redislock.store_acquire",
    "celery_redislock.store_connections",
    "celery_redislock.store_parking",
    "celery_redislock.store_release",
    "celery_redislock.store_slots",
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


#: Longest module, class and task module (lines, ``end_lineno - lineno + 1`` for a class).
MODULE_LIMIT, CLASS_LIMIT, TASK_MODULE_LIMIT = 450, 300, 300

#: Modules over ``MODULE_LIMIT`` (path in the package: lines). They may only shrink.
OVER_LIMIT: dict[str, int] = {}
#: Classes over ``CLASS_LIMIT`` (``path:class``: lines). They may only shrink.
CLASSES_OVER_LIMIT: dict[str, int] = {}
#: Import circles left as they are (none): each as the sorted modules in it.
ALLOWED_CYCLES: set[tuple[str, ...]] = set()


def module_sizes() -> dict[str, int]:
    return {
        path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines())
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def class_sizes() -> dict[str, int]:
    sizes = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                name = f"{path.relative_to(PACKAGE).as_posix()}:{node.name}"
                sizes[name] = node.end_lineno - node.lineno + 1
    return sizes


def over_the_limit(sizes: dict[str, int], limit: int, ratchet: dict[str, int]) -> list[str]:
    """What breaks the limit and is not listed, grew past its listed size, or left the list."""
    found = []
    for name, size in sizes.items():
        listed = ratchet.get(name)
        if size > limit and listed is None:
            found.append(f"{name}: {size} lines, over {limit}")
        elif listed is not None and size > listed:
            found.append(f"{name}: grew to {size} lines from {listed} (listed over the limit)")
        elif listed is not None and size <= limit:
            found.append(f"{name}: {size} lines, under {limit} now: take it off the list")
    found += [f"{name}: listed, but gone" for name in ratchet if name not in sizes]
    return found


def test_no_module_is_over_its_line_limit() -> None:
    sizes = module_sizes()
    assert over_the_limit(sizes, MODULE_LIMIT, OVER_LIMIT) == []
    assert sizes["task.py"] <= TASK_MODULE_LIMIT, f"task.py has {sizes['task.py']} lines"


def test_no_class_is_over_its_line_limit() -> None:
    assert over_the_limit(class_sizes(), CLASS_LIMIT, CLASSES_OVER_LIMIT) == []


def all_imports(path: Path) -> set[str]:
    """Every module ``path`` names in an import: type-only and function-level ones too."""
    found: set[str] = set()
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else None
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolved against this module's package
                base = (package or module_name(path)).split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            names = [f"{module}.{alias.name}" for alias in node.names]
            submodules = [name for name in names if _is_module(name)]
            found.update(submodules)
            if len(submodules) < len(names):
                found.add(module)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    cycles = []
    for group in groups:
        # A shortest way back to the group's first module, found breadth first.
        start = min(group)
        paths = {nxt: [start, nxt] for nxt in sorted(graph[start] & group)}
        queue = list(paths)
        while start not in paths:
            node = queue.pop(0)
            for nxt in sorted(graph[node] & group):
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    queue.append(nxt)
        cycles.append(paths[start])
    return cycles


def test_no_import_circle_even_for_the_type_checker() -> None:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {
        name: {imported for imported in all_imports(path) if imported in modules} - {name}
        for name, path in modules.items()
    }
    cycles = [
        " -> ".join(cycle)
        for cycle in import_cycles(graph)
        if tuple(sorted(set(cycle))) not in ALLOWED_CYCLES
    ]
    assert cycles == [], "import circles:\n" + "\n".join(cycles)


def private_task_members() -> set[str]:
    """The private names ``task.py``'s task classes define (``_lock_settings``, ...)."""
    names: set[str] = set()
    for node in ast.parse((PACKAGE / "task.py").read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name.startswith("Singleton"):
            for member in ast.walk(node):
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(member.name)
                elif isinstance(member, ast.Name) and isinstance(member.ctx, ast.Store):
                    names.add(member.id)
                elif isinstance(member, ast.Attribute) and isinstance(member.ctx, ast.Store):
                    names.add(member.attr)
    return {name for name in names if name.startswith("_") and not name.endswith("__")}


def test_no_module_uses_the_task_class_private_members() -> None:
    private = private_task_members()
    assert "_lock_settings" in private  # the scan finds them
    used = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "task.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                used.append(f"{module_name(path)}:{node.lineno}: .{node.attr}")
    assert used == [], "private members of SingletonTask used outside task.py"


def test_every_module_opens_with_a_docstring_saying_its_job() -> None:
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and len(doc.split()) >= 4, f"{module_name(path)} has no docstring"


#: The modules that run a lock's scripts: they read a key's companions from
#: its family (``key_family.family_of``) and name none themselves.
STORE_MODULES = (
    "aiostore",
    "pending",
    "protocol",
    "store",
    "store_acquire",
    "store_connections",
    "store_parking",
    "store_release",
    "store_slots",
)
#: What naming a companion key looks like (``key_family``'s functions).
COMPANION_NAMERS = {
    "debounce_key",
    "fence_key",
    "handoff_keys",
    "next_run_key",
    "queued_key",
    "release_channel",
    "slot_key",
    "slot_keys",
}


def test_the_stores_name_no_companion_key_they_read_it_from_the_family() -> None:
    named = []
    for module in STORE_MODULES:
        path = PACKAGE / f"{module}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in (
                "celery_redislock.keys",
                "celery_redislock.key_family",
            ):
                named += [
                    f"{module}:{node.lineno}: {alias.name}"
                    for alias in node.names
                    if alias.name in COMPANION_NAMERS
                ]
    assert named == [], "companion keys named in a store module (use family_of(key))"
