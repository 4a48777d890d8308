"""Pins of the test environments: what a lock refresh changed, and the lowest-versions pins.

    python requirements/pins.py diff OLD NEW      # versions added, removed or changed between locks
    python requirements/pins.py lowest            # each range of pyproject.toml at its lower bound
    python requirements/pins.py versions          # the installed versions of the packages that matter

Used by the Makefile (``make lock``, ``make test-lowest``, ``make test-latest``); stdlib only.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Printed by `versions` and listed in the tested matrix of docs/quickstart.md.
SHOWN = [
    "torch",
    "lightning",
    "transformers",
    "peft",
    "tensorboard",
    "pandas",
    "pyarrow",
    "matplotlib",
    "numpy",
    "torchmetrics",
    "rich",
    "accelerate",
    "safetensors",
]
# What the lowest-versions environment needs beyond the lower bounds, each with its reason.
LOWEST_EXTRA = {
    # pandas 2.0, pyarrow 14 and matplotlib 3.7 were built against numpy 1.x and fail to import
    # under numpy 2 ("A module that was compiled using NumPy 1.x cannot be run in NumPy 2").
    "numpy": "numpy<2",
    # tensorboard before 2.21 imports pkg_resources when its command starts (tensorboard/default.py),
    # which setuptools 82 removed: `tensorboard --logdir` fails without it.
    "setuptools": "setuptools<82",
}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")
_LOWER = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*>=\s*([^\s,;]+)\s*$")


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """``{name: version}`` of a lock file's ``name==version`` lines (comments ignored)."""
    pins = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        match = _PIN.match(line.strip())
        if match:
            pins[_name(match[1])] = match[2]
    return pins


def diff(old: Path, new: Path) -> list[str]:
    """One line per package whose pin was added, removed or changed."""
    before, after = read_pins(old), read_pins(new)
    lines = []
    for name in sorted(before.keys() | after.keys()):
        was, now = before.get(name), after.get(name)
        if was == now:
            continue
        if was is None:
            lines.append(f"  + {name} {now}")
        elif now is None:
            lines.append(f"  - {name} {was}")
        else:
            lines.append(f"    {name} {was} -> {now}")
    return lines


def _requirements(extras: tuple[str, ...]) -> list[str]:
    import tomllib  # Python >= 3.11: only these developer commands need it

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = project["optional-dependencies"]
    return list(project["dependencies"]) + [r for extra in extras for r in found[extra]]


def lowest(skip: tuple[str, ...] = ("torch",)) -> list[str]:
    """``name==lower bound`` for every ``name>=bound`` of the package's and ``[dev]``'s ranges.

    Exact pins (``==``) stay as they are; ``skip`` (torch: the Makefile installs its pinned build)
    is left out; ``LOWEST_EXTRA`` adds what the old releases need to import. The ``[stacks]``
    extra is not among them: its lowest ``datasets`` (3.6) needs pyarrow>=15, above pyarrow's 14.
    """
    pins: dict[str, str] = {}
    for requirement in _requirements(("dev",)):
        match = _LOWER.match(requirement)
        exact = _PIN.match(requirement)
        if match and _name(match[1]) not in skip:
            pins[_name(match[1])] = f"{_name(match[1])}=={match[3]}"
        elif exact and _name(exact[1]) not in skip:
            pins[_name(exact[1])] = requirement
        elif not match and not exact:
            raise SystemExit(f"pins.py lowest: cannot read the lower bound of {requirement!r}")
    pins.update(LOWEST_EXTRA)
    return sorted(pins.values())


def versions() -> list[str]:
    """``name version`` of each package in ``SHOWN`` as installed here."""
    lines = []
    for name in SHOWN:
        try:
            lines.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{name} (not installed)")
    return lines


def main(argv: list[str]) -> int:
    if argv[:1] == ["diff"] and len(argv) == 3:
        changes = diff(Path(argv[1]), Path(argv[2]))
        print("\n".join(changes) if changes else "  (no version changed)")
    elif argv == ["lowest"]:
        print("\n".join(lowest()))
    elif argv == ["versions"]:
        print("\n".join(versions()))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
