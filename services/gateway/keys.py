"""The agent gateway's API keys: one per agent or tenant, never the mesh's token, stored hashed,
revoked by deleting its line.

The key file (``gateway.api_keys_path``) maps a name to ``sha256:<hex digest of the key>``; the key
itself is shown once, when it is issued (``rollmesh gateway-key FILE NAME``), and kept by whoever
runs the agent. A leaked key file gives no key. The gateway reads the file again when it changes, so
a key deleted from it stops working within a second, without a restart.

Why not the mesh token: it also updates weights, pauses engines and commits versions. An agent
that needs only completions must not hold it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)
PREFIX = "sha256:"


def hash_key(key: str) -> str:
    return PREFIX + hashlib.sha256(key.encode()).hexdigest()


def read_key_file(path: str | Path) -> dict[str, str]:
    """{name: hash} from ``path``; ``ValueError`` naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"api_keys_path: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"api_keys_path: {path} must hold a JSON object of names to key hashes")
    for name, value in data.items():
        if not (isinstance(value, str) and value.startswith(PREFIX) and len(value) == len(PREFIX) + 64):
            raise ValueError(
                f"api_keys_path: {path}: {name!r} is not a key hash ('sha256:<64 hex digits>'); keys are stored "
                "hashed: issue them with `rollmesh gateway-key FILE NAME`"
            )
    return data


@contextlib.contextmanager
def _editing(path: Path):
    """The file's keys to change, under a lock (two editors at once would lose one's change); written
    whole to a private temporary file renamed over it (a reader never sees half a file)."""
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        keys = read_key_file(path) if path.exists() else {}
        yield keys
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")  # mode 0600
        with os.fdopen(fd, "w") as f:
            json.dump(keys, f, indent=1)
        os.replace(tmp, path)


def issue_key(path: str | Path, name: str, prefix: str = "rk-") -> str:
    """A new key for ``name`` (replacing its old one), its hash written to ``path``; returns the key.
    ``prefix``: what the key starts with (the tinker SDK takes only keys that start with ``tml-``)."""
    key = prefix + secrets.token_urlsafe(32)
    with _editing(Path(path)) as keys:
        keys[name] = hash_key(key)
    return key


def revoke_key(path: str | Path, name: str) -> bool:
    """Delete ``name``'s key; False when it has none."""
    with _editing(Path(path)) as keys:
        return keys.pop(name, None) is not None


class KeyRing:
    """Who a request's bearer key belongs to. ``hashes``: {name: ``sha256:…``}; ``path``: a key file
    read again when it changes (looked at every ``recheck_s`` at most)."""

    def __init__(
        self, hashes: dict[str, str] | None = None, path: str | Path | None = None, recheck_s: float = 1.0
    ) -> None:
        self.path, self.recheck_s, self._seen, self._checked = (Path(path) if path else None), recheck_s, None, 0.0
        self._set(hashes or {})
        if self.path is not None:
            self._reload()

    @classmethod
    def of_keys(cls, keys: dict[str, str]) -> KeyRing:
        """From plain {name: key} (tests, benches); a deployment's file holds hashes only."""
        return cls({name: hash_key(key) for name, key in keys.items()})

    def _set(self, hashes: dict[str, str]) -> None:
        self._hashes = [(h.encode(), name) for name, h in hashes.items()]

    def _reload(self) -> None:
        st = self.path.stat()  # a rename gives a new inode; two writes within a clock tick, another size
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            self._set(read_key_file(self.path))
            self._seen = seen

    def owner(self, authorization: str | None) -> str | None:
        if self.path is not None and time.monotonic() - self._checked >= self.recheck_s:
            self._checked = time.monotonic()
            try:
                self._reload()
            except FileNotFoundError:  # deleted: every key it held is revoked (an empty ring refuses all)
                if self._hashes:
                    log.warning("%s is gone: every key is refused until it is back", self.path)
                self._set({})
                self._seen = None
            except (OSError, ValueError):  # a file mid-edit: the keys read last stay
                pass
        if not authorization or not authorization.startswith("Bearer "):
            return None
        got, found = hash_key(authorization[len("Bearer ") :].strip()).encode(), None
        for h, name in self._hashes:  # every hash is compared: the time does not say which matched
            if hmac.compare_digest(got, h):
                found = name
        return found
