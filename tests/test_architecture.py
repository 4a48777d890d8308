"""docs/architecture.md's tree names every module of the package, every example and every benchmark
script, and nothing that is gone: read from the files, so the page cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
#: One entry of the tree: its indent, then one or more names (``pl.py, hf.py``), each a module or
#: a folder (``monitor/``); a description follows. Lines that continue a description start deeper
#: with words, not names.
ENTRY = re.compile(r"^(?P<indent> *)(?P<names>[\w.]+(?:\.py|/)(?:, [\w.]+(?:\.py|/))*)(?:\s|$)")


def listed_paths(text: str) -> set[str]:
    """The paths the first code block of ``text`` lists, folders included (``a/b/c.py``, ``a/``)."""
    block = text.split("```", 2)[1]
    folders: list[tuple[int, str]] = []  # (indent, folder) from the top of the tree down
    paths = set()
    for line in block.splitlines():
        match = ENTRY.match(line)
        if match is None:
            continue
        indent = len(match["indent"])
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = "".join(folder for _, folder in folders)
        for name in match["names"].split(", "):
            paths.add(parent + name)
            if name.endswith("/"):
                folders.append((indent, name))
    return paths


def source_paths(folder: str) -> set[str]:
    """Every Python file under ``folder`` (``__init__.py`` aside: its folder is its entry), and
    the folders that hold one."""
    paths = set()
    for path in (ROOT / folder).rglob("*.py"):
        relative = path.relative_to(ROOT)
        if "__pycache__" in relative.parts:
            continue
        paths |= {"/".join(relative.parts[:i]) + "/" for i in range(1, len(relative.parts))}
        if path.name != "__init__.py":
            paths.add(relative.as_posix())
    return paths


@pytest.mark.parametrize("folder", ["spectral_callbacks", "examples", "benchmarks"])
def test_the_architecture_page_lists_every_file_and_nothing_that_is_gone(folder: str) -> None:
    listed = listed_paths(DOC.read_text(encoding="utf-8"))
    assert sorted(source_paths(folder) - listed) == [], "not in docs/architecture.md"
    gone = [path for path in listed if path.startswith(f"{folder}/") and not (ROOT / path).exists()]
    assert sorted(gone) == [], "in docs/architecture.md, not on disk"


def test_the_reader_follows_the_trees_folders() -> None:
    text = """```
pkg/
  a.py           one
  sub/           a folder
    b.py, c.py   two
                 a description that goes on
  d.py           back at the top
other/
  e.py
```"""
    assert listed_paths(text) == {
        "pkg/", "pkg/a.py", "pkg/sub/", "pkg/sub/b.py", "pkg/sub/c.py", "pkg/d.py", "other/",
        "other/e.py",
    }  # fmt: skip
