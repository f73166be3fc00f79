"""`python -m {{ cookiecutter.package_name }}` trains, like `{{ cookiecutter.package_name }}-train`."""

from .entry import train

if __name__ == "__main__":
    train()
