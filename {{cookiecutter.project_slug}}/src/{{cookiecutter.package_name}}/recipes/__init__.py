"""The commands, one module (or package) each: each reads as the run's flow."""
