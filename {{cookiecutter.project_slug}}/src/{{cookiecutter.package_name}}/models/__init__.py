"""LightningModules (training logic); the networks they train live in `nets`."""
