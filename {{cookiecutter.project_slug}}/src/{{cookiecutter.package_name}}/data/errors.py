"""The error of a setting or input that cannot work. It is defined here, at the bottom of the
package, so that the data modules, which import nothing else of the project, raise the very
class that every command reports in one line (`errors.ConfigError` is this class)."""


class ConfigError(Exception):
    """A setting or input that cannot work: the message says which and what to do instead."""
