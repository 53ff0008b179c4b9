"""The Python client: calls a deployed function over HTTPS, verifying the Ember dev CA."""
import contextlib
import json
import os
import ssl
from collections.abc import Iterator
from typing import Any

import httpx

from ember.home import Home


class RemoteError(RuntimeError):
    def __init__(self, status: int, type: str, message: str):
        super().__init__(f"{status} {type}: {message}")
        self.status, self.type, self.message = status, type, message


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            error = {"type": "http_error", "message": response.text[:500]}
        raise RemoteError(response.status_code, error.get("type", "error"), error.get("message", ""))


class Client:
    def __init__(self, url: str, key: str, ca: str | os.PathLike | bool = True, timeout: float = 600.0):
        self.url, self.key = url.rstrip("/"), key
        verify = ca if isinstance(ca, bool) else ssl.create_default_context(cafile=str(ca))
        self.http = httpx.Client(verify=verify, timeout=timeout)

    @classmethod
    def from_env(cls) -> "Client":
        """EMBER_URL and EMBER_KEY, else the gateway `ember serve` recorded in EMBER_HOME."""
        home = Home()
        url, key = os.environ.get("EMBER_URL"), os.environ.get("EMBER_KEY")
        if url is None and home.gateway_file.exists():
            url = json.loads(home.gateway_file.read_text())["url"]
        if key is None and home.cli_key_file.exists():
            key = home.cli_key_file.read_text().strip()
        if not url or not key:
            raise RuntimeError("no Ember gateway found: run `ember serve APP.py`, or set EMBER_URL and EMBER_KEY")
        return cls(url, key, os.environ.get("EMBER_CA") or home.ca)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key}"} | kwargs.pop("headers", {})
        response = self.http.request(method, f"{self.url}{path}", headers=headers, **kwargs)
        _raise_for_error(response)
        return response

    @contextlib.contextmanager
    def stream(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        """A response read as it arrives (`iter_lines()`); an error reply raises RemoteError as `request` does."""
        headers = {"Authorization": f"Bearer {self.key}"} | kwargs.pop("headers", {})
        with self.http.stream(method, f"{self.url}{path}", headers=headers, **kwargs) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for_error(response)
            yield response

    def call(self, app: str, target: str, kwargs: dict) -> Any:
        return self.request("POST", f"/{app}/{target}", json=kwargs).json()["result"]
