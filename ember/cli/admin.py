"""How the CLI reaches a gateway: its admin API, at EMBER_URL with EMBER_KEY, else the one `ember serve` runs here."""
import httpx

from ember.client import Client, GatewayUnreachable
from ember.home import Home


def admin_client() -> Client:
    return Client.from_env()


def running_gateway() -> Client | None:
    """The admin API of a gateway that answers now; None when none runs here (a gateway.json may be left by one that
    is gone)."""
    if not Home().gateway_file.exists():
        return None
    client = Client.from_env()
    try:
        client.request("GET", "/healthz")
    except (httpx.TransportError, GatewayUnreachable):
        client.http.close()
        return None
    return client
