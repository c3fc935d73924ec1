"""The trainer process: the training loop (``trainer/loop.py``) wired to the mesh."""
