"""Keys over a real HTTPS socket: scopes decided on the served route, expiry, revocation on the next request."""
import time
from pathlib import Path

APPS = Path(__file__).parent / "apps"


def _create(served, *args: str) -> str:
    return served.cli("keys", "create", "--quiet", *args).stdout.strip()


def test_scopes_expiry_and_revocation_through_the_cli(serve):
    served = serve(APPS / "quick.py")
    served.cli("deploy", str(APPS / "other.py"))
    app_key = _create(served, "--name", "quick-only", "--scope", "app:quick")
    fn_key = _create(served, "--name", "add-only", "--scope", "fn:quick/add")
    with served.client(app_key) as http:
        assert http.post("/quick/add", json={"a": 1, "b": 2}).json()["result"]["sum"] == 3
        denied = http.post("/other/secret", json={})
        assert denied.status_code == 403 and denied.json()["error"]["type"] == "forbidden"
        assert "app:other" in denied.json()["error"]["message"]
        # The Host header names nothing the gateway authorises on.
        assert http.post("/other/secret", json={}, headers={"Host": "quick"}).status_code == 403
        assert http.get("/admin/status").status_code == 403
    with served.client(fn_key) as http:
        assert http.post("/quick/add", json={"a": 2, "b": 2}).status_code == 200
        assert http.post("/quick/sleepy", json={"seconds": 0}).status_code == 403
        # Refused before the body is read: a body far over the size limit still gets the 403.
        assert http.post("/quick/sleepy", content=b"x" * (20 << 20)).status_code == 403

    listed = served.cli("keys", "list").stdout
    assert "quick-only" in listed and "app:quick" in listed and app_key not in listed
    with served.client(app_key) as http:
        assert http.post("/quick/add", json={"a": 1, "b": 1}).status_code == 200
        served.cli("keys", "revoke", "quick-only")
        revoked = http.post("/quick/add", json={"a": 1, "b": 1})  # the very next request
        assert revoked.status_code == 401 and revoked.json()["error"]["type"] == "unauthorized"

    short = _create(served, "--name", "short", "--expires", "2s")
    with served.client(short) as http:
        assert http.post("/quick/add", json={"a": 1, "b": 1}).status_code == 200
        time.sleep(2.1)
        assert http.post("/quick/add", json={"a": 1, "b": 1}).status_code == 401


def test_admin_key_api(serve):
    served = serve(APPS / "quick.py")
    with served.client(served.key("root", admin=True)) as admin:
        made = admin.post("/admin/keys", json={"name": "svc", "scopes": ["fn:quick/add"], "rpm": 5})
        assert made.status_code == 201, made.text
        key = made.json()
        assert key["secret"].startswith(f"ek_{key['id']}_") and key["rpm"] == 5
        assert all("secret" not in k for k in admin.get("/admin/keys").json())
        bad = admin.post("/admin/keys", json={"name": "x", "scopes": ["app:../etc"]})
        assert bad.status_code == 422 and bad.json()["error"]["type"] == "invalid_scope"
        for name in ("\x00", "ops\x1b[2J", "line\nbreak"):  # a terminal escape would run in `ember keys list`
            bad = admin.post("/admin/keys", json={"name": name})
            assert bad.status_code == 422 and "printable" in bad.json()["error"]["message"], bad.text
        assert admin.post("/admin/keys", json={"name": "équipe données"}).status_code == 201
        with served.client(key["secret"]) as user:
            assert user.post("/quick/add", json={"a": 1, "b": 1}).status_code == 200
            assert admin.delete(f"/admin/keys/{key['id']}").status_code == 200
            assert user.post("/quick/add", json={"a": 1, "b": 1}).status_code == 401
        assert admin.delete("/admin/keys/nobody").status_code == 404
