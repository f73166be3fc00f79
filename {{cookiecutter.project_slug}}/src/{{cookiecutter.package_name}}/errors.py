"""Errors that the command line reports in one line (exit code 1) instead of a traceback."""


class ConfigError(Exception):
    """A setting or input that cannot work: the message says which and what to do instead."""


class TrainingError(Exception):
    """Training cannot go on (e.g. non-finite losses): the message says why and what to try."""
