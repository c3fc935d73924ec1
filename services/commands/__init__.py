"""The ``rollmesh`` subcommands, one module per group (``services/cli.py`` puts them together)."""
