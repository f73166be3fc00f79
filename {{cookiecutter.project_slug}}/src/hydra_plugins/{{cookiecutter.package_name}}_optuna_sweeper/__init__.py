"""A Hydra sweeper backed by current Optuna (hydra-optuna-sweeper pins optuna<3).

Hydra imports this package at every start to find plugins, so nothing here imports optuna
until a sweep starts.
"""
