"""Runs a verifiers environment against the mesh (``__main__.py``)."""
