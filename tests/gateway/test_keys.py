"""API keys in real SQLite: shown once, stored hashed, revocable."""
import sqlite3

from ember.gateway.keys import KeyStore


def test_create_verify_revoke(tmp_path):
    keys = KeyStore(tmp_path / "ember.db")
    key, secret = keys.create("ci", admin=True)
    assert secret.startswith(f"ek_{key.id}_") and len(secret) > 40
    stored = sqlite3.connect(tmp_path / "ember.db").execute("SELECT hash FROM api_keys").fetchone()[0]
    assert secret not in stored and len(stored) == 64
    assert keys.verify(secret) == key
    assert keys.verify(secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
    assert keys.verify("ek_" + key.id) is None and keys.verify("garbage") is None
    other, other_secret = keys.create("ci")
    assert [k.id for k in keys.revoke("ci")] == [key.id, other.id]
    assert keys.verify(secret) is None and keys.verify(other_secret) is None
    assert all(k.revoked for k in KeyStore(tmp_path / "ember.db").all())
