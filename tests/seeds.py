"""The seed of this run of the tests: fresh each run, printed, and replayable.

A test on random inputs asserts what holds for every input, so any seed must pass; a fresh seed
per run is how the suite finds an input where it does not. One seed serves the whole run: the
``SEEDS`` that test modules parametrize with (so it is in the test ids) and each test's ``random``
module, which conftest.py seeds with it before every test. pytest's header shows it and a failing
test's report repeats it; ``SPECTRAL_TEST_SEED=<int>`` fixes it, to replay a failure (the same
test ids, the same draws) or to run with a fixed seed.
"""

from __future__ import annotations

import os
import random

#: The environment variable that fixes the run's seed.
SEED_VARIABLE = "SPECTRAL_TEST_SEED"

#: ``SPECTRAL_TEST_SEED`` where it is set, else drawn from the operating system at import (never
#: from ``random``'s own state, which conftest.py seeds).
RUN_SEED = int(os.environ.get(SEED_VARIABLE) or random.SystemRandom().randrange(2**31))


def run_seed() -> int:
    """The run's seed, in ``[0, 2**31)`` unless ``SPECTRAL_TEST_SEED`` says otherwise."""
    return RUN_SEED
