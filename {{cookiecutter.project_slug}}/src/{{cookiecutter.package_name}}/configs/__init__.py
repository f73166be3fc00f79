"""Hydra config tree; a package so Hydra finds it in an installed wheel."""
