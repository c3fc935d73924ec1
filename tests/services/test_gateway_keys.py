"""Gateway keys: one per agent, never the mesh token, stored hashed, revoked by deleting them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.keys import KeyRing, hash_key, issue_key


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, timeout=60)


def bearer(key: str) -> str:
    return f"Bearer {key}"


def test_an_issued_key_is_shown_once_and_stored_as_its_hash(tmp_path):
    path = tmp_path / "keys.json"
    alice = cli("gateway-key", str(path), "alice")
    assert alice.returncode == 0, alice.stderr
    key = alice.stdout.strip()
    stored = json.loads(path.read_text())
    assert stored == {"alice": hash_key(key)} and key not in path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600
    bob = issue_key(path, "bob")
    ring = KeyRing(path=GatewayConfig(api_keys_path=str(path)).api_keys_path)
    assert ring.owner(bearer(key)) == "alice" and ring.owner(bearer(bob)) == "bob"
    assert ring.owner(bearer("rk-guess")) is None and ring.owner(key) is None  # not a bearer header


def test_a_revoked_key_stops_working_without_a_restart(tmp_path):
    path = tmp_path / "keys.json"
    key, other = issue_key(path, "alice"), issue_key(path, "bob")
    ring = KeyRing(path=path, recheck_s=0.0)
    assert ring.owner(bearer(key)) == "alice"
    res = cli("gateway-key", str(path), "alice", "--revoke")
    assert res.returncode == 0 and "revoked 'alice'" in res.stdout, res.stderr
    assert ring.owner(bearer(key)) is None and ring.owner(bearer(other)) == "bob"
    path.write_text("{not json")  # a file mid-edit: the keys read last still hold
    assert ring.owner(bearer(other)) == "bob"


def test_deleting_the_key_file_revokes_every_key(tmp_path):
    """The keys read last once stayed valid with their file gone: deleting it revoked nothing."""
    path = tmp_path / "keys.json"
    key = issue_key(path, "alice")
    ring = KeyRing(path=path, recheck_s=0.0)
    assert ring.owner(bearer(key)) == "alice"
    path.unlink()
    assert ring.owner(bearer(key)) is None
    again = issue_key(path, "alice")  # a new file: its keys, read afresh
    assert ring.owner(bearer(again)) == "alice" and ring.owner(bearer(key)) is None


def test_a_file_of_plain_keys_is_refused_at_load(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text('{"alice": "k1"}')
    with pytest.raises(ValueError, match=r"'alice' is not a key hash .*rollmesh gateway-key"):
        GatewayConfig(api_keys_path=str(path))


def test_the_gateway_will_not_start_without_a_key_file_and_never_takes_the_mesh_token(tmp_path):
    res = cli("serve", "gateway", "--set", "gateway.port=0")
    assert res.returncode == 2 and "gateway.api_keys_path: no key file" in res.stderr, res.stderr
    path = tmp_path / "keys.json"
    issue_key(path, "agent")
    ring = KeyRing(path=path)
    assert ring.owner(bearer(os.environ["ROLLMESH_TOKEN"])) is None  # the run's token opens nothing here
