"""The package's imports, read from its source: no module imports itself back through others, and
the pipeline's folders only import the folders before them.

Every import statement counts, also one inside a function or under ``TYPE_CHECKING``: a lazy
import hides a circle from Python, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import spectral_callbacks

PACKAGE = Path(spectral_callbacks.__file__).parent
NAME = PACKAGE.name
#: The pipeline's folders in data-flow order: each may import only those before it (and the
#: package's top-level modules, the vocabulary every part shares).
PIPELINE = (
    "functional",
    "targets",
    "monitor",
    "integrations",
    "offline",
    "tensorboard_plugin",
    "cli",
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imports(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from package import module`` is the module)."""
    modules = source_modules(root)
    package = root.name

    def known(name: str) -> str:
        while name not in modules:  # ``a.b.function`` -> ``a.b``
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                found |= {known(a.name) for a in node.names if a.name.split(".")[0] == package}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package, up level - 1
                    base = module.split(".")
                    if path.name != "__init__.py":
                        base = base[:-1]
                    base = base[: len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] == package:
                    for alias in node.names:
                        full = f"{source}.{alias.name}"
                        found.add(full if full in modules else known(source))
        found.discard(module)
        graph[module] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a pipeline folder into one after it, as ``a -> b``."""

    def folder(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 2 and parts[1] in PIPELINE else None

    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            here, there = folder(module), folder(target)
            if here and there and PIPELINE.index(there) > PIPELINE.index(here):
                found.append(f"{module} -> {target}")
    return found


def write_package(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / "pkg" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_package_has_no_import_cycle() -> None:
    assert cycles(imports(PACKAGE)) == []


def test_no_pipeline_folder_imports_a_later_one() -> None:
    assert upward(imports(PACKAGE)) == []


def test_the_reader_sees_every_package_module() -> None:
    # Guards the reader itself: the graph must hold the modules whose edges these tests rely on.
    graph = imports(PACKAGE)
    assert f"{NAME}.monitor.figures" in graph[f"{NAME}.monitor.figure_process"]
    assert f"{NAME}.charts" in graph[f"{NAME}.offline.differences"]


@pytest.mark.parametrize(
    "files",
    [
        {  # a lazy import inside a function closes the circle
            "__init__.py": "",
            "a.py": "from pkg.b import g\n",
            "b.py": "def g():\n    from pkg.a import f\n",
        },
        {  # relative imports, through a package's module
            "__init__.py": "",
            "sub/__init__.py": "",
            "sub/a.py": "from . import b\n",
            "sub/b.py": "from ..c import h\n",
            "c.py": "import pkg.sub.a\n",
        },
    ],
)
def test_a_circle_is_found(tmp_path: Path, files: dict[str, str]) -> None:
    assert cycles(imports(write_package(tmp_path, files))) != []


def test_a_chain_is_no_circle(tmp_path: Path) -> None:
    root = write_package(
        tmp_path,
        {"__init__.py": "", "a.py": "from pkg import b\n", "b.py": "import pkg.c\n", "c.py": ""},
    )
    assert imports(root)["pkg.a"] == {"pkg.b"}
    assert cycles(imports(root)) == []
