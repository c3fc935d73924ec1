"""Errors both loops share across their ports (neither may import the other's)."""

from __future__ import annotations


class TransientError(Exception):
    """A call that never reached its target, or found it busy or restarting (no engine in
    rotation, connection lost, server overloaded): worth another try within the caller's
    deadline. ``code`` names the cause for metrics (e.g. ``UNAVAILABLE``)."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
