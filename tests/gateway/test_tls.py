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
