"""``python -m spectral_callbacks.tensorboard_plugin --logdir runs``: TensorBoard with the SPECTRAL tab.

For a checkout that is not pip-installed (so the ``tensorboard_plugins`` entry point is not
registered): TensorBoard's own command line and flags, with this plugin added to its standard
ones. Installed, plain ``tensorboard --logdir runs`` shows the same tab.
"""

from __future__ import annotations

import sys

from tensorboard import default, program

from spectral_callbacks.tensorboard_plugin.plugin import SpectralPlugin


def main(argv: list[str] | None = None) -> int:
    # An installed copy registers itself too (the entry point): keep this one, not both.
    others = [p for p in default.get_plugins() if getattr(p, "plugin_name", None) != "spectral"]
    server = program.TensorBoard(plugins=[*others, SpectralPlugin])
    server.configure(argv=["tensorboard", *(sys.argv[1:] if argv is None else argv)])
    return server.main()


if __name__ == "__main__":
    sys.exit(main())
