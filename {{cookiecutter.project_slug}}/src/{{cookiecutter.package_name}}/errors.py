"""Errors that mean the user must change something; the CLI prints them as one line, exit code 1."""


class ConfigError(Exception):
    """A setting, path or file the user gave cannot be used; the message says what to do."""
