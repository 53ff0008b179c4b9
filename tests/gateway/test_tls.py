"""The dev CA signs a server certificate that a client trusting only ca.pem verifies."""
import ssl

from cryptography import x509

from ember.gateway.tls import ensure_ca, issue_server_cert


def test_server_cert_chains_to_the_ca_with_local_names(tmp_path):
    cert_path, key_path = issue_server_cert(tmp_path, "127.0.0.1")
    ca_path, _ = ensure_ca(tmp_path)
    assert ensure_ca(tmp_path)[0].read_bytes() == ca_path.read_bytes()  # the CA stays across runs
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in sans.get_values_for_type(x509.DNSName)
    assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    assert oct(key_path.stat().st_mode)[-3:] == "600"
    client = ssl.create_default_context(cafile=str(ca_path))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_path, key_path)
    client_in, client_out, server_in, server_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(client_in, client_out, server_hostname="localhost")
    s = server.wrap_bio(server_in, server_out, server_side=True)
    for _ in range(10):
        for side, outbox, peer_in in ((c, client_out, server_in), (s, server_out, client_in)):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
            peer_in.write(outbox.read())
    assert c.version() and c.getpeercert()["subject"]


# `ember serve` for other machines: the printed URL, extra names, and a certificate of one's own, over real HTTPS.

import datetime  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from ember.gateway.tls import machine_names, primary_address  # noqa: E402

APP = Path(__file__).parent / "apps" / "slow.py"


def _verified_as(served, name: str) -> dict:
    """Handshake with the gateway (at its loopback address) as a client that asked for `name`, trusting only ca.pem."""
    port = int(served.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with served.tls().wrap_socket(raw, server_hostname=name) as tls:
            return tls.getpeercert()


def test_serving_every_interface_prints_a_reachable_url_the_certificate_covers(serve):
    served = serve(APP, "--host", "0.0.0.0", "--tls-name", "ember.test", "--tls-name", "10.1.2.3", "--new-key", "me")
    host = served.url.split("//")[1].rsplit(":", 1)[0]
    assert host != "127.0.0.1" and host == (primary_address() or socket.gethostname())
    curl = next(line.strip() for line in served.stdout if line.strip().startswith("curl --cacert"))
    assert served.url in curl
    result = subprocess.run(["bash", "-c", curl + " -sS"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == '{"result": 3.0}', result.stderr  # curl verified the name
    for name in ["ember.test", "10.1.2.3", socket.gethostname(), *machine_names()]:
        assert _verified_as(served, name)["subject"]
    with pytest.raises(ssl.SSLCertVerificationError):
        _verified_as(served, "not-this-host.test")


def _own_pair(folder: Path, name: str, days: int = 30, start_days: int = -1) -> tuple[Path, Path, Path]:
    """A CA of our own and a certificate it signed for `name` (the way an organisation's CA issues one)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Test Org CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=365))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now + datetime.timedelta(days=start_days))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def test_own_certificate_is_served_and_the_dev_ca_is_not_used(serve, tmp_path):
    ca, cert, key = _own_pair(tmp_path / "org", "localhost")
    # On every interface: the printed URL names the host the certificate is for, not an address it does not cover.
    served = serve(APP, "--host", "0.0.0.0", "--tls-cert", str(cert), "--tls-key", str(key), "--new-key", "me")
    text = "".join(served.stdout)
    assert served.url.startswith("https://localhost:") and f"Certificate: {cert}" in text and "--cacert" not in text
    secret = next(line.split(": ")[-1].strip() for line in served.stdout if line.startswith("API key"))
    org = ssl.create_default_context(cafile=str(ca))
    with httpx.Client(verify=org) as http:
        reply = http.post(f"{served.url}/slow/wait", json={"seconds": 0}, headers={"Authorization": f"Bearer {secret}"})
    assert reply.json() == {"result": 0.0}
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{served.url}/healthz")  # the system's trust store does not know the org's CA
    assert not served.ca.exists()  # no dev CA was made or used
    status = subprocess.run([sys.executable, "-m", "ember.cli", "status"], env=served.env | {"EMBER_CA": str(ca)},
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "app slow" in status.stdout, status.stderr  # found by name, the org's CA


def _serve_fails(tmp_path: Path, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "ember.cli", "serve", str(APP), "--port", "0", *args],
                            env=os.environ | {"EMBER_HOME": str(tmp_path / "home")}, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


def test_a_certificate_that_cannot_be_served_is_refused_at_start(tmp_path):
    _, cert, key = _own_pair(tmp_path / "a", "localhost")
    _, other_cert, other_key = _own_pair(tmp_path / "b", "localhost")
    _, expired, expired_key = _own_pair(tmp_path / "c", "localhost", days=-1, start_days=-10)
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(serialization.load_pem_private_key(key.read_bytes(), None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    assert "together" in _serve_fails(tmp_path, "--tls-cert", str(cert))
    assert "cannot read it" in _serve_fails(tmp_path, "--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(key))
    assert "is not a PEM certificate" in _serve_fails(tmp_path, "--tls-cert", str(key), "--tls-key", str(key))
    assert "is not the key of" in _serve_fails(tmp_path, "--tls-cert", str(cert), "--tls-key", str(other_key))
    assert "expired on" in _serve_fails(tmp_path, "--tls-cert", str(expired), "--tls-key", str(expired_key))
    assert "is encrypted" in _serve_fails(tmp_path, "--tls-cert", str(cert), "--tls-key", str(encrypted))
    assert not (tmp_path / "home" / "gateway.json").exists()
    assert _serve_fails(tmp_path, "--tls-cert", str(other_cert), "--tls-key", str(key)).startswith("error: --tls-key")
