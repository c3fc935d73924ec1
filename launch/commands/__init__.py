"""The ``rollmesh`` subcommands, one module per group (``launch/cli.py`` puts them together)."""
