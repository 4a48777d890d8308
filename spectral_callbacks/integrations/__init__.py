"""Frontends: each translates one framework's hooks and loggers into the core's calls."""
