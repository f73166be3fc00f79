"""`python -m <package>.recipes.serve` runs `<package>-serve`."""

if __name__ == "__main__":
    from ... import cli

    cli.serve()
