"""The training-time core: schedule → snapshot → engines (compute) → reporting/alerts → dashboards.

Nothing here imports a training framework; the frontends in ``spectral_callbacks.integrations``
translate their hooks and loggers into calls on these parts.
"""
