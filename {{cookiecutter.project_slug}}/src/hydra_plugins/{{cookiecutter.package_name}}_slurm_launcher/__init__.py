"""Hydra's submitit SLURM launcher, made to end a sweep whose jobs the scheduler can never start
and to read job states from `squeue` where the cluster keeps no accounting.

Hydra imports this package at every start to find plugins, so nothing here imports submitit
until a sweep starts.
"""
