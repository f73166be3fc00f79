"""`python -m <package>.recipes.prepare` runs `<package>-prepare`."""

if __name__ == "__main__":
    from ... import cli

    cli.prepare()
