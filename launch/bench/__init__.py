"""``rollmesh bench ...``: each benchmark is a module here that returns its numbers."""


class BadOption(ValueError):
    """A benchmark option out of range, named in the message; the CLI prints it without a traceback."""
