"""Lightning modules, data modules and Hydra configs for training."""

__version__ = "0.1.0"
