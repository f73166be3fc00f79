"""Jinja filters of this template; cookiecutter and cruft load this file as `local_extensions`."""

import json

from cookiecutter.utils import simple_filter


@simple_filter
def toml_string(value: object) -> str:
    """A TOML basic string. Jinja's `tojson` writes characters outside the BMP (an emoji) as JSON
    surrogate pairs, which TOML rejects; TOML takes them as they are."""
    return json.dumps(str(value), ensure_ascii=False)
