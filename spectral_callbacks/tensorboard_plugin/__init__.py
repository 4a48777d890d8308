"""The SPECTRAL tab of TensorBoard: the study's charts over the runs of any ``--logdir``, live.

Installing the package registers :class:`~spectral_callbacks.tensorboard_plugin.plugin.SpectralPlugin`
under the ``tensorboard_plugins`` entry point, so ``tensorboard --logdir runs`` shows the tab.

* ``plugin.py`` - the TensorBoard plugin: routes, request parsing, the static frontend;
* ``source.py`` - scalars read through TensorBoard's public data provider, cached, as tidy rows;
* ``views.py`` - each chart's JSON from tidy rows (the rows ``spectral-callbacks export`` writes);
* ``downsample.py`` - fewer points per series, keeping each bucket's first, last, min and max;
* ``static/`` - the frontend: plain ES modules drawing SVG, no build step (see docs/dashboards.md).
"""
