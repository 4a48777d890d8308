"""``python -m spectral_callbacks.cli``: the same as the ``spectral-callbacks`` console script."""

import sys

from spectral_callbacks.cli.main import main

sys.exit(main())
