"""The layering, read from the source with `ast`: applications (kvserve/: the CLI, the
replay client) above services above libraries, services apart from each other, and
no import circles among modules. The libraries have floors of their own: the engine
above the transfer engine above the service runtime (libs/common) above the wire
protocol, which imports nothing of the project.

Every import counts, at module level or inside a function or an `if TYPE_CHECKING:`
block: a circle a type checker or a lazy import hides is still a circle to a reader.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvserve", "services", "libs")
# top to bottom: each layer may import only itself and the layers below it
LAYERS = ("kvserve", "services", "libs.engine", "libs.transfer", "libs.common", "libs.protocol")


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


def _parse(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed again once if CPython 3.11 fails it with "AST constructor
    recursion depth mismatch": an interpreter error, not the file's (seen once in a whole
    suite's run, while earlier tests' background threads were still compiling)."""
    source = path.read_text()
    try:
        return ast.parse(source, str(path))
    except SystemError as e:
        if "recursion depth mismatch" not in str(e):
            raise
        return ast.parse(source, str(path))


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (a package import counts as its __init__)."""
    tree = _parse(path)
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


def _layer(module: str) -> int:
    for level, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return level
    raise AssertionError(f"{module} belongs to no layer of {LAYERS}")


def test_every_module_belongs_to_a_layer():
    for name in _graph():
        if name != "libs":  # the namespace's own __init__
            _layer(name)


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for name, targets in _graph().items():
        if name == "libs":
            continue
        level = _layer(name)
        wrong += [f"{name} -> {t}" for t in targets if t != "libs" and _layer(t) < level]
    assert wrong == []


def test_the_protocol_imports_nothing_heavy():
    """The wire protocol loads without torch or numpy: a client or a conductor reading
    messages needs neither."""
    heavy = {"torch", "numpy", "safetensors", "transformers"}
    wrong = []
    for path in (ROOT / "libs" / "protocol").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            wrong += [f"{path.name} -> {n}" for n in names if n.split(".")[0] in heavy]
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
