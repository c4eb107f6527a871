"""The package's layering, read from its source with `ast`: no module imports itself back
through others, and the interop layer and the command line use only the names the
checkpoint package exports to them, never another module's private ones."""

from __future__ import annotations

import ast
import pathlib

import eqx_train

PACKAGE = pathlib.Path(eqx_train.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = ["eqx_train", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, tuple[pathlib.Path, ast.Module]]:
    return {
        _module_name(path): (path, ast.parse(path.read_text(), str(path)))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def _imports(name: str, path: pathlib.Path, tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(absolute module, imported names) of every import in a module, wherever it stands
    (top level, inside a function, under `if TYPE_CHECKING`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((module, [alias.name for alias in node.names]))
    return found


def _edges(modules) -> dict[str, set[str]]:
    """Which eqx_train modules each one imports (`from . import _x` imports module `_x`)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, tree) in modules.items():
        for module, names in _imports(name, path, tree):
            submodules = {f"{module}.{n}" for n in names} & modules.keys()
            graph[name] |= submodules
            # `from package import _submodule` imports the submodule, not a name of the
            # package's own (the package runs first, as for any submodule import).
            if module in modules and (not names or len(submodules) < len(names)):
                graph[name].add(module)
    for name in graph:
        graph[name].discard(name)
        # Importing a submodule runs its package's __init__ first; that edge is not a cycle
        # of the code's own making (the packages' __init__ only re-export, lazily).
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_module_of_the_package_imports_itself_back_through_others():
    cycle = _find_cycle(_edges(_modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _reaches_into_private_names(name: str, path: pathlib.Path, tree: ast.Module) -> list[str]:
    """Imports of another module's underscored name: `from x import _y`, or a module path
    through a private module of another package (`from ..checkpoints._format import y`);
    and attribute access `obj._y` on anything but `self`/`cls`. A package's private names
    are its own and its subpackages' (`eqx_train._tree` serves all of eqx_train)."""
    own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def inside(owner: str) -> bool:
        return own_package == owner or own_package.startswith(owner + ".")

    problems = []
    for module, names in _imports(name, path, tree):
        parts = module.split(".")
        if any(_private(p) and not inside(".".join(parts[:i])) for i, p in enumerate(parts)):
            problems.append(f"imports from {module}")
        elif not inside(module):
            problems += [f"imports {module}.{n}" for n in names if _private(n)]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            problems.append(f"line {node.lineno}: .{node.attr}")
    return problems


def test_interop_and_the_command_line_use_only_exported_names():
    modules = _modules()
    checked = {
        name: entry
        for name, entry in modules.items()
        if name.startswith(("eqx_train.interop", "eqx_train._cli"))
    }
    assert "eqx_train._cli" in checked and "eqx_train.interop._hf" in checked
    problems = {
        name: found
        for name, (path, tree) in checked.items()
        if (found := _reaches_into_private_names(name, path, tree))
    }
    assert not problems, problems


def test_the_import_graph_checks_can_fail(tmp_path):
    """The checks above are not vacuous: a planted cycle and a planted private import are
    found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]
    source = "from ..checkpoints import _format\nfrom ..checkpoints._storage import X\nx._y\n"
    path = PACKAGE / "interop" / "_planted.py"
    found = _reaches_into_private_names("eqx_train.interop._planted", path, ast.parse(source))
    assert found == [
        "imports eqx_train.checkpoints._format",
        "imports from eqx_train.checkpoints._storage",
        "line 3: ._y",
    ]
