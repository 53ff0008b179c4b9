"""The gateway's SQLite file under a lock another process holds, on a full disk (a tmpfs the test mounts), and its
permissions: a real `ember serve`, real SQLite, real files."""
import os
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ember.gateway.database import BUSY_TIMEOUT

APPS = Path(__file__).parent / "apps"


def test_a_locked_database_stalls_neither_health_checks_nor_calls_by_cached_keys(serve):
    served = serve(APPS / "quick.py")
    known, fresh = served.key("known"), served.key("fresh")
    with served.client(known) as http:
        assert http.post("/quick/add", json={"a": 1, "b": 2}).status_code == 200  # the key is now cached
    locker = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys, time\n"
         "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
         "db.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(float(sys.argv[2]))",
         str(served.home / "ember.db"), str(BUSY_TIMEOUT + 2)], stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "locked"
        waited = {}

        def call_with_fresh_key():
            began = time.monotonic()
            with served.client(fresh) as http:
                waited["reply"] = http.post("/quick/add", json={"a": 1, "b": 2})
            waited["s"] = time.monotonic() - began

        blocked = threading.Thread(target=call_with_fresh_key)
        blocked.start()
        health = []
        with served.client(None) as anonymous, served.client(known) as http:
            time.sleep(1.2)  # past the key cache's TTL: the known key now needs the database too
            for _ in range(10):
                began = time.monotonic()
                assert anonymous.get("/healthz").status_code == 200
                health.append(time.monotonic() - began)
                assert http.post("/quick/add", json={"a": 2, "b": 3}).json()["result"]["sum"] == 5
                time.sleep(0.2)
        blocked.join(30)
        assert max(health) < 1.0, health  # it took 9.5 s while the event loop waited on the lock
        reply = waited["reply"]
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "database_busy"
        assert reply.headers["retry-after"] == "1" and "locked by another process" in reply.json()["error"]["message"]
        assert BUSY_TIMEOUT - 0.5 < waited["s"] < BUSY_TIMEOUT + 2
    finally:
        locker.kill()
        locker.wait()
    with served.client(fresh) as http:  # once the lock is gone, the same key works
        assert http.post("/quick/add", json={"a": 1, "b": 2}).status_code == 200


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs mounted where the `serve` fixture puts EMBER_HOME (set up before it, so unmounted after it)."""
    home = tmp_path / "ember-home"
    home.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(home)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    yield home
    subprocess.run(["umount", "-l", str(home)], check=False)


def fill(folder: Path) -> Path:
    """Write a file until the disk is full; the file's path (delete it to free the space)."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (65536, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_answers_507_loses_nothing_and_enforces_every_revoke(small_disk, serve):
    served = serve(APPS / "quick.py")
    home = served.home
    admin, kept = served.key("admin", admin=True), served.key("kept")
    doomed = [served.key(f"doomed-{i}") for i in range(3)]
    for key in [kept, *doomed]:
        with served.client(key) as http:
            assert http.post("/quick/add", json={"a": 1, "b": 1}).status_code == 200
    ids = {key: key.split("_")[1] for key in doomed}
    filler = fill(home)
    with served.client(admin) as http:
        created = http.post("/admin/keys", json={"name": "new"})
        assert created.status_code == 507, created.text
        error = created.json()["error"]
        assert error["type"] == "insufficient_storage" and "full" in error["message"] and "'new'" in error["message"]
        limits = http.put("/admin/apps/quick/limits", json={"rpm": 5})
        assert limits.status_code == 507 and "limits of app 'quick'" in limits.json()["error"]["message"]
        for key in doomed[:2]:  # by id; then by name
            revoked = http.delete(f"/admin/keys/{ids[key]}")
            assert revoked.status_code == 507 and "revoked on this gateway" in revoked.json()["error"]["message"]
        assert http.delete("/admin/keys/doomed-2").status_code == 507
        listed = {k["id"]: k for k in http.get("/admin/keys").json()}
        assert all(listed[ids[key]]["revoked"] for key in doomed) and listed[kept.split("_")[1]]["revoked"] is None
    for key in doomed:  # acknowledged revokes are enforced at once, though the database has none of them
        with served.client(key) as http:
            assert http.post("/quick/add", json={"a": 1, "b": 1}).status_code == 401
    with served.client(kept) as http:  # nothing else changed
        assert http.post("/quick/add", json={"a": 2, "b": 2}).json()["result"]["sum"] == 4
    with sqlite3.connect(home / "ember.db") as db:
        assert db.execute("SELECT COUNT(*) FROM api_keys WHERE revoked IS NOT NULL").fetchone()[0] == 0

    filler.unlink()
    with served.client(admin) as http:
        assert http.post("/admin/keys", json={"name": "new"}).status_code == 201  # and the pending revokes are saved
    with sqlite3.connect(home / "ember.db") as db:
        revoked = {row[0] for row in db.execute("SELECT id FROM api_keys WHERE revoked IS NOT NULL")}
    assert revoked == set(ids.values())
    for key in doomed:
        with served.client(key) as http:
            assert http.post("/quick/add", json={"a": 1, "b": 1}).status_code == 401


def test_secret_material_is_private(serve, tmp_path):
    served = serve(APPS / "quick.py")
    home = served.home
    for path in [home / "ember.db", home / "tls" / "ca-key.pem", home / "tls" / "server-key.pem", home / "cli.key"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((home / "tls").stat().st_mode) == 0o700


def test_a_private_key_is_private_before_its_first_byte(tmp_path):
    """The key file is a FIFO the test reads: the mode it has when the first bytes arrive is what a reader could see."""
    from ember.gateway.tls import ensure_ca

    key_path = tmp_path / "ca-key.pem"
    os.mkfifo(key_path, 0o644)
    seen = {}

    def read_first_bytes():
        with open(key_path, "rb") as fifo:
            seen["first"] = fifo.read(16)
            seen["mode"] = stat.S_IMODE(os.stat(key_path).st_mode)
            fifo.read()

    reader = threading.Thread(target=read_first_bytes)
    reader.start()
    ensure_ca(tmp_path)
    reader.join(10)
    assert seen["first"].startswith(b"-----BEGIN") and seen["mode"] == 0o600


def test_a_read_only_ember_home_gives_an_error_that_names_the_fix(tmp_path):
    home = tmp_path / "ro"
    home.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(home)], capture_output=True)
    if mounted.returncode != 0:  # not root: a home under a plain file cannot be written either
        (tmp_path / "file").write_text("")
        home = tmp_path / "file" / "home"
    try:
        env = os.environ | {"EMBER_HOME": str(home)}
        for args in (["keys", "create", "--name", "x"], ["keys", "list"], ["serve", str(APPS / "quick.py")]):
            result = subprocess.run([sys.executable, "-m", "ember.cli", *args], env=env, capture_output=True,
                                    text=True, timeout=60)
            assert result.returncode == 1, (args, result.stderr)
            assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr, (args, result.stderr)
            assert "writ" in result.stderr and str(home) in result.stderr, (args, result.stderr)
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "-l", str(home)], check=False)
