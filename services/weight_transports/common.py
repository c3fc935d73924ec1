"""What every weight transport shares."""

from __future__ import annotations


def engine_failures(res) -> str:
    """The engines' errors of an UpdateWeights* reply, one clause each."""
    return "; ".join(f"{e.engine or 'proxy'}: {e.message}" for e in res.engines if not e.success)
