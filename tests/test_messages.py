"""The package's warnings point at the user's line, whatever ran the user's code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_warning_from_a_python_dash_c_script_is_shown_not_raised() -> None:
    # `python -c`: __main__'s loader is the builtin importer, whose get_source raises ImportError
    # when warnings look for the line to show; a run's closing warning ended such a script with
    # exit status 1 (ImportError: '__main__' is not a built-in module).
    code = "from spectral_callbacks.messages import rank_zero_warn\nrank_zero_warn('left: 2')\n"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "<string>:2: UserWarning: left: 2" in done.stderr
