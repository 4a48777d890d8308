"""The training-time core: schedule → snapshot → engine (compute) → reporting → dashboards.

Nothing here imports a training framework; the frontends in ``spectral_callbacks.integrations``
translate their hooks and loggers into calls on these parts.
"""
