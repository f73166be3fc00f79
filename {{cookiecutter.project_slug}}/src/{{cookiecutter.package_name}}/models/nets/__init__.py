"""Plain `nn.Module` networks: no training logic, no Lightning."""
