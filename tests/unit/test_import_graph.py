"""The layering, read from the source with `ast`: applications (kvserve/: the CLI, the
replay client) above services above libraries, services apart from each other, and
no import circles among modules.

Every import counts, at module level or inside a function or an `if TYPE_CHECKING:`
block: a circle a type checker or a lazy import hides is still a circle to a reader.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvserve", "services", "libs")  # top to bottom: each may import only those below it


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            found[_module_name(path)] = path
    return found


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (a package import counts as its __init__)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets.add(module)
            targets.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    resolved = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, name, known) for name, path in modules.items()}


def test_the_graph_is_read_from_every_layer():
    graph = _graph()
    assert {name.split(".")[0] for name in graph} == set(PACKAGES)
    assert "services.gateway.app" in graph["services.gateway.__main__"]  # the reader itself works


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for name, targets in _graph().items():
        level = PACKAGES.index(name.split(".")[0])
        wrong += [f"{name} -> {t}" for t in targets if PACKAGES.index(t.split(".")[0]) < level]
    assert wrong == []


def test_no_service_imports_another():
    wrong = []
    for name, targets in _graph().items():
        if name.startswith("services."):
            own = name.split(".")[1]
            wrong += [f"{name} -> {t}" for t in targets if t.startswith("services.") and t.split(".")[1] != own]
    assert wrong == []


def test_no_import_circles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    assert circles == [], circles
