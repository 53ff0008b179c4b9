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


def test_scopes_expiry_limits_and_an_old_database(tmp_path):
    import time

    import pytest

    from ember.gateway.ratelimit import Limits

    db = tmp_path / "ember.db"
    old = sqlite3.connect(db)  # a database from before scopes existed
    old.execute(
        "CREATE TABLE api_keys (id TEXT PRIMARY KEY, name TEXT NOT NULL, hash TEXT NOT NULL, admin INTEGER NOT NULL, "
        "created REAL NOT NULL, revoked REAL)"
    )
    old.commit()
    old.close()
    keys = KeyStore(db)
    key, secret = keys.create(
        "svc", scopes=["fn:shop/Cart", "app:chat"], expires=time.time() + 60, limits=Limits(10, 1000, 2)
    )
    again = KeyStore(db).verify(secret)
    assert again.scopes == ("app:chat", "fn:shop/Cart") and again.limits == Limits(10, 1000, 2) and not again.admin
    assert again.allows("chat", "Chat") and again.allows("shop", "Cart")
    assert not again.allows("shop", "Admin") and not again.allows("chatter", "Chat")
    assert KeyStore(db).create("any")[0].allows("whatever", "fn")  # no app/fn scope: every app
    assert keys.create("root", scopes=["admin"])[0].admin

    _, expired = keys.create("gone", expires=time.time() - 1)
    assert keys.verify(expired) is None
    with pytest.raises(ValueError, match="app:APP"):
        keys.create("bad", scopes=["app:Chat"])

    assert keys.verify(secret) is not None  # now cached ...
    keys.revoke(key.id)
    assert keys.verify(secret) is None  # ... and the revoke dropped it at once


def test_an_expiry_or_a_limit_no_key_could_have_is_refused(tmp_path):
    """A NaN expiry was stored as NULL (a key that never expires); one past year 9999 broke `ember keys list` for
    every key; an rpm past 2**63 failed the database write with an OverflowError."""
    import math
    import time

    import pytest

    from ember.gateway.ratelimit import Limits

    keys = KeyStore(tmp_path / "ember.db")
    for expires in (math.nan, math.inf, time.time() + 11 * 365 * 86400):
        with pytest.raises(ValueError, match="a key expires within 3650 days"):
            keys.create("k", expires=expires)
    for limits in ({"requests_per_minute": 10**30}, {"tokens_per_minute": 10**12 + 1}, {"max_concurrent": 0}):
        with pytest.raises(ValueError, match="must be a whole number from 1 to"):
            Limits(**limits)
    assert keys.all() == []
