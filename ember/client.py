"""The Python client: calls a deployed function over HTTPS, verifying the Ember dev CA."""
import contextlib
import json
import os
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx

from ember.home import Home


class GatewayUnreachable(RuntimeError):
    """No gateway answered, or its certificate is not trusted; the message names the fix."""


class RemoteError(RuntimeError):
    def __init__(self, status: int, type: str, message: str, retry_after: float | None = None):
        super().__init__(f"{status} {type}: {message}")
        self.status, self.type, self.message, self.retry_after = status, type, message, retry_after


MID_STREAM = 500  # the status a RemoteError carries for a generator that failed after its reply began


class EventReader:
    """The values of a generator call's server-sent events, fed line by line: `feed` returns a value for each
    `data:` event, raises RemoteError for `event: error` or for a stream that ends (`finish`) without `event: done`."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.data: list[str] = []
        self.done = False

    def feed(self, line: str) -> list[Any]:
        if line.startswith("event:"):
            self.name = line[6:].strip()
        elif line.startswith("data:"):
            self.data.append(line[5:].removeprefix(" "))
        elif not line and self.data:
            name, payload = self.name, json.loads("\n".join(self.data))
            self.name, self.data = None, []
            if name == "done":
                self.done = True
            elif name == "error":
                error = payload.get("error", {}) if isinstance(payload, dict) else {}
                raise RemoteError(MID_STREAM, error.get("type", "error"), error.get("message", ""))
            else:
                return [payload]
        return []

    def finish(self) -> None:
        if not self.done:
            raise RemoteError(502, "stream_cut", "the stream of values ended before the function finished; retry")


JSON_HEADERS = {"Content-Type": "application/json"}


def call_body(target: str, kwargs: dict) -> bytes:
    """A call's keyword arguments as the JSON body it sends. A value JSON cannot carry is named with its argument
    and what to send instead; httpx's own message named neither ("Object of type bytes is not JSON serializable")."""
    try:
        return json.dumps(kwargs, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        for name, value in kwargs.items():
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as problem:
                raise type(exc)(
                    f"argument {name!r} of {target} cannot be sent ({problem}): a call carries JSON values - str, int, "
                    "finite float, bool, None, and lists and dicts of them - so send bytes as base64 text, a set as a "
                    "list, a datetime as ISO text, an array as a list") from None
        raise


def _is_events(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


def _expect_result(response: httpx.Response, target: str) -> None:
    if _is_events(response):
        raise RemoteError(response.status_code, "is_generator",
                          f"{target} is a generator function: iterate its values with .remote_gen()")


def _expect_events(response: httpx.Response, target: str) -> None:
    if not _is_events(response):
        raise RemoteError(response.status_code, "not_a_generator",
                          f"{target} is not a generator function: call it with .remote() instead of .remote_gen()")


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            error = {"type": "http_error", "message": response.text[:500]}
        try:
            retry_after = float(response.headers["retry-after"])
        except (KeyError, ValueError):
            retry_after = None
        raise RemoteError(response.status_code, error.get("type", "error"), error.get("message", ""), retry_after)


def _trust(ca: str | os.PathLike | None, also: Path | None = None) -> ssl.SSLContext:
    """The CA file `ca`, else the system's trust store (plus `also`, the dev CA of this EMBER_HOME, where it exists)."""
    if ca is not None:
        if not Path(ca).is_file():
            raise GatewayUnreachable(f"EMBER_CA={ca} is not a file: point it at the gateway's CA certificate (the "
                                     "'CA certificate:' path `ember serve` printed, copied to this machine)")
        return ssl.create_default_context(cafile=str(ca))
    context = ssl.create_default_context()
    if also is not None and also.is_file():
        context.load_verify_locations(cafile=str(also))
    return context


def _unreachable(url: str, found_in: str, exc: httpx.ConnectError) -> GatewayUnreachable:
    """The error for a gateway that did not answer at `url`, found through `found_in`, naming the fix."""
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return GatewayUnreachable(f"the certificate of {url} is not trusted ({exc}): set EMBER_CA to the "
                                  "gateway's CA file (the 'CA certificate:' path `ember serve` printed)")
    if found_in == "EMBER_URL":
        return GatewayUnreachable(f"no gateway answers at EMBER_URL={url} ({exc}): is it running there?")
    if not found_in:
        return GatewayUnreachable(f"no gateway answers at {url} ({exc}): is `ember serve` running?")
    return GatewayUnreachable(f"no gateway answers at {url} ({exc}); it was recorded in {found_in}, "
                              "which has stopped: start it again with `ember serve APP.py`, or set EMBER_URL")


class Client:
    def __init__(self, url: str, key: str, ca: str | os.PathLike | bool | ssl.SSLContext = True,
                 timeout: float = 600.0, found_in: str = ""):
        self.url, self.key, self.ca = url.rstrip("/"), key, ca
        self.found_in = found_in  # where the URL came from, for the error when nothing answers there
        verify = ca if isinstance(ca, (bool, ssl.SSLContext)) else _trust(ca)
        self.http = httpx.Client(verify=verify, timeout=timeout)

    @classmethod
    def from_env(cls) -> "Client":
        """EMBER_URL and EMBER_KEY (EMBER_CA to trust a dev CA), else the gateway `ember serve` recorded in
        EMBER_HOME/gateway.json with the admin key it wrote to cli.key."""
        home = Home()
        url, key, ca = os.environ.get("EMBER_URL"), os.environ.get("EMBER_KEY"), os.environ.get("EMBER_CA")
        found_in = "EMBER_URL"
        if url is None and home.gateway_file.exists():
            recorded = json.loads(home.gateway_file.read_text())
            url = recorded["url"]
            found_in = f"{home.gateway_file}, written by `ember serve` (pid {recorded.get('pid')})"
            ca = ca or recorded.get("ca")  # None when the gateway serves a certificate of its own (--tls-cert)
        if key is None and home.cli_key_file.exists():
            key = home.cli_key_file.read_text().strip()
        if not url or not key:
            raise GatewayUnreachable("no Ember gateway found: run `ember serve APP.py` (EMBER_HOME="
                                     f"{home.root}), or set EMBER_URL and EMBER_KEY (and EMBER_CA for a dev CA)")
        return cls(url, key, _trust(ca, also=home.root / "tls" / "ca.pem"), found_in=found_in)

    def _send(self, send, method: str, path: str, **kwargs: Any):
        try:
            return send(method, f"{self.url}{path}", **kwargs)
        except httpx.ConnectError as exc:
            raise _unreachable(self.url, self.found_in, exc) from None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key}"} | kwargs.pop("headers", {})
        response = self._send(self.http.request, method, path, headers=headers, **kwargs)
        _raise_for_error(response)
        return response

    @contextlib.contextmanager
    def stream(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        """A response read as it arrives (`iter_lines()`); an error reply raises RemoteError as `request` does."""
        headers = {"Authorization": f"Bearer {self.key}"} | kwargs.pop("headers", {})
        with contextlib.ExitStack() as stack:
            try:
                response = stack.enter_context(
                    self.http.stream(method, f"{self.url}{path}", headers=headers, **kwargs))
            except httpx.ConnectError as exc:
                raise _unreachable(self.url, self.found_in, exc) from None
            if response.status_code >= 400:
                response.read()
                _raise_for_error(response)
            yield response

    def call(self, app: str, target: str, kwargs: dict) -> Any:
        body = call_body(target, kwargs)
        with self.stream("POST", f"/{app}/{target}", content=body, headers=JSON_HEADERS) as response:
            _expect_result(response, target)
            return json.loads(response.read())["result"]

    def iterate(self, app: str, target: str, kwargs: dict) -> Iterator[Any]:
        """The values a generator function yields, each as soon as the gateway relays it."""
        body = call_body(target, kwargs)
        with self.stream("POST", f"/{app}/{target}", content=body, headers=JSON_HEADERS) as response:
            _expect_events(response, target)
            reader = EventReader()
            for line in response.iter_lines():
                yield from reader.feed(line)
                if reader.done:
                    return
            reader.finish()


class AsyncClient:
    """The Client's calls for asyncio code (`await f.remote.aio(...)`); same gateway, key and CA."""

    def __init__(self, url: str, key: str, ca: str | os.PathLike | bool | ssl.SSLContext = True,
                 timeout: float = 600.0, connections: int = 100, found_in: str = ""):
        self.url, self.key, self.found_in = url.rstrip("/"), key, found_in
        verify = ca if isinstance(ca, (bool, ssl.SSLContext)) else _trust(ca)
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.http = httpx.AsyncClient(verify=verify, timeout=timeout, limits=limits)

    @classmethod
    def from_env(cls, connections: int = 100) -> "AsyncClient":
        sync = Client.from_env()
        sync.http.close()
        return cls(sync.url, sync.key, sync.ca, connections=connections, found_in=sync.found_in)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key}"} | kwargs.pop("headers", {})
        try:
            response = await self.http.request(method, f"{self.url}{path}", headers=headers, **kwargs)
        except httpx.ConnectError as exc:
            raise _unreachable(self.url, self.found_in, exc) from None
        _raise_for_error(response)
        return response

    async def call(self, app: str, target: str, kwargs: dict) -> Any:
        body = call_body(target, kwargs)
        async with self.stream("POST", f"/{app}/{target}", content=body, headers=JSON_HEADERS) as response:
            _expect_result(response, target)
            return json.loads(await response.aread())["result"]

    @contextlib.asynccontextmanager
    async def stream(self, method: str, path: str, **kwargs: Any) -> AsyncIterator[httpx.Response]:
        headers = {"Authorization": f"Bearer {self.key}"} | kwargs.pop("headers", {})
        async with contextlib.AsyncExitStack() as stack:
            try:
                response = await stack.enter_async_context(
                    self.http.stream(method, f"{self.url}{path}", headers=headers, **kwargs))
            except httpx.ConnectError as exc:
                raise _unreachable(self.url, self.found_in, exc) from None
            if response.status_code >= 400:
                await response.aread()
                _raise_for_error(response)
            yield response

    async def iterate(self, app: str, target: str, kwargs: dict) -> AsyncIterator[Any]:
        body = call_body(target, kwargs)
        async with self.stream("POST", f"/{app}/{target}", content=body, headers=JSON_HEADERS) as response:
            _expect_events(response, target)
            reader = EventReader()
            async for line in response.aiter_lines():
                for value in reader.feed(line):
                    yield value
                if reader.done:
                    return
            reader.finish()
