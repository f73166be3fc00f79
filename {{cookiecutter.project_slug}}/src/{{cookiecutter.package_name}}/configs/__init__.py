"""Hydra config tree; a package so Hydra finds it in an installed wheel. Importing it registers
the settings' schemas (schema.py) that the primary configs name in their defaults."""

from .schema import register

register()
