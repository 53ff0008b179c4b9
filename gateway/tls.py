"""A local dev CA and a server certificate signed by it, kept in EMBER_HOME/tls (curl --cacert ca.pem verifies)."""
import datetime
import ipaddress
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Ember dev"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    """Written into a file that is mode 0600 before its first byte (a chmod afterwards leaves a window)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, 0o600)  # an older file of the same name may have had a wider mode
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))


def ensure_ca(folder: Path) -> tuple[Path, Path]:
    """The CA stays across runs, so a client that trusts ca.pem once keeps trusting the gateway."""
    cert_path, key_path = folder / "ca.pem", folder / "ca-key.pem"
    if cert_path.exists() and key_path.exists():
        return cert_path, key_path
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("Ember local CA"))
        .issuer_name(_name("Ember local CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(key, key_path)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def primary_address() -> str | None:
    """The address other machines reach this one at: the source address of the default route (a UDP connect sends
    nothing), else what the hostname resolves to; None when neither is more than loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routed by the default route, never answered
            address = probe.getsockname()[0]
        except OSError:
            address = None
    if address is None or ipaddress.ip_address(address).is_loopback:
        try:
            address = socket.gethostbyname(socket.gethostname())
        except OSError:
            return None
    return None if ipaddress.ip_address(address).is_loopback else address


def machine_names() -> set[str]:
    """This machine's names and addresses: hostname, fully qualified name, what they resolve to, the primary
    address."""
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    for name in list(names - {"localhost"}):
        try:
            names |= {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    return names | {a for a in (primary_address(),) if a}


def _sans(names: set[str]) -> list[x509.GeneralName]:
    ips = {"127.0.0.1", "::1"}
    out: list[x509.GeneralName] = []
    for name in sorted(names - {"0.0.0.0", "::", ""}):
        try:
            ips.add(str(ipaddress.ip_address(name.split("%")[0])))  # a link-local address may carry its zone
        except ValueError:
            out.append(x509.DNSName(name))
    out += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in sorted(ips)]
    return out


def certificate_names(cert_path: str | Path) -> list[str]:
    """The DNS names and IP addresses a PEM certificate (its first, the server's own) is valid for."""
    cert = x509.load_pem_x509_certificates(Path(cert_path).read_bytes())[0]
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return sans.get_values_for_type(x509.DNSName) + [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]


class CertificateError(ValueError):
    """A certificate or key given with --tls-cert/--tls-key cannot be served; the message says why and what to do."""


def check_own_certificate(cert_path: str, key_path: str) -> None:
    """Fail at start, not at the first client: both files readable PEM, the key unencrypted and matching, the
    certificate in date."""
    import ssl

    def read(path: str, what: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise CertificateError(f"--tls-{what} {path}: cannot read it ({exc.strerror or exc})") from None

    cert_pem, key_pem = read(cert_path, "cert"), read(key_path, "key")
    try:
        cert = x509.load_pem_x509_certificates(cert_pem)[0]  # the server's own first, then its chain
    except ValueError:
        raise CertificateError(f"--tls-cert {cert_path} is not a PEM certificate (-----BEGIN CERTIFICATE-----)"
                               ) from None
    try:
        key = serialization.load_pem_private_key(key_pem, None)
    except TypeError:
        raise CertificateError(f"--tls-key {key_path} is encrypted; give it without a passphrase "
                               f"(openssl pkey -in {key_path} -out plain-key.pem)") from None
    except ValueError:
        raise CertificateError(f"--tls-key {key_path} is not a PEM private key (-----BEGIN PRIVATE KEY-----)") from None
    raw = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if cert.public_key().public_bytes(*raw) != key.public_key().public_bytes(*raw):
        raise CertificateError(f"--tls-key {key_path} is not the key of --tls-cert {cert_path}; give the pair "
                               "issued together")
    now = datetime.datetime.now(datetime.UTC)
    if cert.not_valid_after_utc < now:
        raise CertificateError(f"--tls-cert {cert_path} expired on {cert.not_valid_after_utc:%Y-%m-%d}; renew it")
    if cert.not_valid_before_utc > now:
        raise CertificateError(f"--tls-cert {cert_path} is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M}"
                               " UTC; check this machine's clock")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert_path, key_path)
    except ssl.SSLError as exc:
        raise CertificateError(f"--tls-cert {cert_path} with --tls-key {key_path} cannot be served: {exc}") from None


def issue_server_cert(folder: Path, host: str, names: Sequence[str] = ()) -> tuple[Path, Path]:
    """A fresh server certificate for this run, valid for localhost, 127.0.0.1, ::1, this machine's names and
    addresses, `host` and `names` (--tls-name)."""
    ca_cert_path, ca_key_path = ensure_ca(folder)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):  # ensure_ca makes an EC key
        raise ValueError(f"{ca_key_path} is not the EC key Ember made: delete {folder} and serve again for a new CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("Ember gateway"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=90))
        .add_extension(x509.SubjectAlternativeName(_sans(machine_names() | {host, *names})), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = folder / "server.pem", folder / "server-key.pem"
    _write_key(key, key_path)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path
