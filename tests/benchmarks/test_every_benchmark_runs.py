"""Every script in benchmarks/ runs to its end at toy size (``--smoke``), so none can rot: a rename
in the package that a benchmark still calls fails here, not in the hands of the next reader.
Nothing is timed; the speed tables are read from full-size runs (docs/performance.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    path
    for path in (ROOT / "benchmarks").glob("*.py")
    if 'if __name__ == "__main__":' in path.read_text()
)


def test_the_benchmarks_folder_is_found() -> None:
    assert len(SCRIPTS) >= 20  # the glob below would otherwise pass on nothing


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_the_script_runs_to_its_end_at_toy_size(script: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(script), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (
        f"{script.name} --smoke exited {done.returncode}:\n{done.stderr[-4000:]}"
    )
    assert done.stdout.strip(), f"{script.name} --smoke printed nothing"
