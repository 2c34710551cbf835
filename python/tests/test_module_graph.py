"""No two modules of the Python package import each other, directly or round a longer circle.

Reads the sources in python/stablebuf/ with ``ast`` (it never imports stablebuf, so it needs no
extension, no torch and no GPU) and builds the import graph between the package's own modules.
Every import counts, wherever it stands: at module level, under ``if TYPE_CHECKING:``, or
inside a function (a late import only hides a circle, it does not break it). An import of a
submodule (``from ._guard import x``, ``from . import _guard``) is an edge to that module; an
import of a name from the package itself (``from . import x`` where ``x`` is no module,
``import stablebuf``) is an edge to ``__init__``. The package's own import of its parent when a
submodule loads is not an edge (every submodule would then close a circle through
``__init__``).

Runs in the pytest suite, and alone without the extension:
``python3 python/tests/test_module_graph.py`` (prints the graph) or
``python3 -m pytest --noconftest python/tests/test_module_graph.py``.
"""

from __future__ import annotations

import ast
import os
import sys
from typing import Dict, List, Optional, Set

PACKAGE = "stablebuf"
SOURCES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)


def _modules(folder: str) -> Dict[str, str]:
    """``{module name: path}`` of the ``.py`` files of the package (``__init__`` included)."""
    return {
        name[:-3]: os.path.join(folder, name)
        for name in sorted(os.listdir(folder))
        if name.endswith(".py")
    }


def _extensions(folder: str) -> Set[str]:
    """The compiled submodules, known by their stubs (``_native.pyi``): leaves of the graph."""
    return {name[:-4] for name in os.listdir(folder) if name.endswith(".pyi")}


def _targets(node: ast.AST, modules: Set[str], extensions: Set[str], package: str) -> Set[str]:
    """The package's modules one import statement imports (compiled ones left out)."""
    found: Set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] == package:
                # `import stablebuf.x` runs stablebuf/__init__.py, then x.
                found.add("__init__")
                if len(parts) > 1 and parts[1] in modules:
                    found.add(parts[1])
        return found
    if not isinstance(node, ast.ImportFrom):
        return found
    if node.level > 0:
        # The package is flat: `.` and anything above it within the package is the package.
        parts = node.module.split(".") if node.module else []
    else:
        if not node.module or node.module.split(".")[0] != package:
            return found
        parts = node.module.split(".")[1:]
    if parts:
        # `from .x import y` / `from stablebuf.x import y`: x is a submodule.
        if parts[0] in modules:
            found.add(parts[0])
        return found
    # `from . import x, y` / `from stablebuf import x`: submodules, or names of __init__.
    for alias in node.names:
        if alias.name in modules:
            found.add(alias.name)
        elif alias.name not in extensions:
            found.add("__init__")
    return found


def import_graph(folder: str = SOURCES, package: str = PACKAGE) -> Dict[str, Set[str]]:
    """``{module: the package's modules it imports}``, for every ``.py`` file of ``folder``."""
    modules = _modules(folder)
    extensions = _extensions(folder)
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read(), filename=path)
        edges: Set[str] = set()
        for node in ast.walk(tree):  # every statement: module level, functions, classes
            edges |= _targets(node, set(modules), extensions, package)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One circle of ``graph`` as ``[a, b, ..., a]``, or ``None`` if it has none."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle is not None:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle is not None:
                return cycle
    return None


def _describe(graph: Dict[str, Set[str]]) -> str:
    return "\n".join(
        f"  {name} -> {', '.join(sorted(targets)) or '(nothing)'}"
        for name, targets in sorted(graph.items())
    )


def test_the_package_modules_import_each_other_in_no_circle():
    graph = import_graph()
    assert "__init__" in graph and len(graph) > 3, f"no package sources under {SOURCES}"
    assert any(graph.values()), "no imports between the package's modules found: parser broken?"
    cycle = find_cycle(graph)
    assert cycle is None, (
        "the modules of python/stablebuf import each other in a circle: "
        + " -> ".join(cycle)
        + "\nimport graph:\n"
        + _describe(graph)
    )


def test_the_check_sees_circles_closed_by_late_and_type_checking_imports(tmp_path):
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("from .a import f\n")
    (package / "a.py").write_text("from . import b\n\ndef f():\n    return b.g()\n")
    (package / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import stablebuf\n"
    )
    graph = import_graph(str(package))
    assert graph == {"__init__": {"a"}, "a": {"b"}, "b": {"a"}, "c": {"__init__"}}
    assert find_cycle(graph) == ["a", "b", "a"]
    (package / "b.py").write_text("def g():\n    return 1\n")
    assert find_cycle(import_graph(str(package))) is None


def test_names_from_the_package_itself_are_edges_to_init(tmp_path):
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text(
        "from .a import x\nfrom . import b, _native\nfrom ._native import E\n"
    )
    (package / "_native.pyi").write_text("class E(Exception): ...\n")
    (package / "a.py").write_text("x = 1\n")
    (package / "b.py").write_text("def later():\n    from . import x\n    return x\n")
    graph = import_graph(str(package))
    assert graph["b"] == {"__init__"}
    assert find_cycle(graph) == ["__init__", "b", "__init__"]


if __name__ == "__main__":
    found = import_graph()
    print(_describe(found))
    circle = find_cycle(found)
    if circle is not None:
        sys.exit("circle: " + " -> ".join(circle))
    print("no circles")
