"""`ember serve`: gateway, autoscaler and local backend for one app, in the foreground, over HTTPS."""
import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import socket
import urllib.parse
from collections.abc import Sequence

import uvicorn

from ember.gateway import banner, connections, memory
from ember.gateway.backends import backend_for
from ember.gateway.client_limits import ClientLimits
from ember.gateway.database import DatabaseError
from ember.gateway.header_limit import MAX_HEADER_BYTES
from ember.gateway.home_lock import HomeLock
from ember.gateway.ratelimit import MemoryLimiter, RedisLimiter
from ember.gateway.reload import AppWatcher
from ember.gateway.server import create_app
from ember.gateway.service import Gateway
from ember.gateway.tls import certificate_names, check_own_certificate, issue_server_cert, primary_address
from ember.home import Home
from ember.package import build, load_app
from ember.runtime import environments, heap, logs, tracing

CLI_KEY_NAME = "ember-cli"
GRACE = 5


def _logging(home: Home) -> None:
    """Readable lines on the console; JSON lines (with trace and request ids, and the access log) in gateway.log."""
    console = logging.StreamHandler()
    console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log_file = logs.json_handler(home.logs / "gateway.log", source="gateway")
    gateway, access = logging.getLogger("ember.gateway"), logging.getLogger(logs.ACCESS)
    gateway.addHandler(console)
    for logger in (gateway, access):
        logger.addHandler(log_file)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _key_id(secret: str) -> str:
    return secret.split("_")[1] if secret.count("_") >= 2 else ""  # ek_<id>_<random>


def _cli_key(gateway: Gateway) -> str:
    """A fresh admin key for the CLI on this machine; its id. The row of this home's previous run goes (deleted, not
    revoked: one row, not one per restart), also when that run was killed before it could delete its own."""
    path = gateway.home.cli_key_file
    previous = path.read_text().strip() if path.exists() else ""
    gateway.keys.delete(CLI_KEY_NAME, _key_id(previous))
    _, secret = gateway.keys.create(CLI_KEY_NAME, admin=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(secret + "\n")
    return _key_id(secret)


def _forget_cli_key(gateway: Gateway, key_id: str | None) -> None:
    """On stop: no admin key outlives the gateway that minted it."""
    with contextlib.suppress(DatabaseError):
        gateway.keys.delete(CLI_KEY_NAME, key_id)
    gateway.home.cli_key_file.unlink(missing_ok=True)


class _Server(uvicorn.Server):
    """uvicorn's server, but a stop signal (SIGINT, SIGTERM) first tells the gateway (new calls get 503, calls still
    running are cut short with a JSON 503 after the grace period) and is not raised again afterwards, so `serve`
    cleans up (gateway.json, the CLI's key, the lock) and exits 0 instead of dying by the signal."""

    def __init__(self, config: uvicorn.Config, on_stop, handshake_timeout: float):
        super().__init__(config)
        self.on_stop, self.handshake_timeout = on_stop, handshake_timeout

    async def startup(self, sockets=None) -> None:
        """uvicorn's, with the TLS handshake given `handshake_timeout` instead of asyncio's 60 s (uvicorn has no
        option for it): a client that connects and never completes the handshake is cut when a slow header is."""
        loop = asyncio.get_running_loop()
        try:
            loop.create_server = functools.partial(  # type: ignore[method-assign]  # uvicorn has no option for it
                loop.create_server, ssl_handshake_timeout=self.handshake_timeout)
        except AttributeError:  # a loop whose methods cannot be replaced keeps its own 60 s handshake timeout
            return await super().startup(sockets=sockets)
        try:
            await super().startup(sockets=sockets)
        finally:
            del loop.create_server  # the loop's own method again

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.on_stop()
        super().handle_exit(sig, frame)


def _reachable(host: str) -> str:
    """The host to print: the machine's address when listening on every interface (127.0.0.1 reaches no one else)."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    return primary_address() or socket.gethostname()


def _url(host: str, port: int) -> str:
    return f"https://{f'[{host}]' if ':' in host else host}:{port}"


def _limiter(redis_url: str | None):
    """Rate-limit state in Redis when gateways share it (--redis or EMBER_REDIS_URL), else in this process."""
    redis_url = redis_url or os.environ.get("EMBER_REDIS_URL")
    if not redis_url:
        return MemoryLimiter()
    import redis.asyncio

    return RedisLimiter(redis.asyncio.Redis.from_url(redis_url))


def _redis_unanswered(redis_url: str | None) -> str | None:
    """A warning when the rate limiter's Redis does not answer at start (the gateway still serves: requests no
    limit applies to need no Redis, and it may come up later); None when it answers or none is set."""
    redis_url = redis_url or os.environ.get("EMBER_REDIS_URL")
    if not redis_url:
        return None
    import redis

    parts = urllib.parse.urlsplit(redis_url)
    shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()   # never print a password
    try:
        with redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=2) as client:
            client.ping()
    except redis.RedisError as exc:
        return (f"Redis at {shown} does not answer ({exc}): requests of keys with rate limits get 503 "
                "rate_limiter_unavailable until it does")
    return None


def serve(app_path: str, host: str = "127.0.0.1", port: int = 8443, new_key: str | None = None,
          backend: str = "local", parked_ram: str | None = None, redis_url: str | None = None,
          routing: str = "affinity", watch: bool = True, openai_model: tuple[str, str] | None = None,
          tls_names: Sequence[str] = (), tls_cert: str | None = None, tls_key: str | None = None,
          limits: ClientLimits | None = None) -> int:
    """`openai_model`: (name, "chat" or "embeddings") when the app serves a model's OpenAI API (ember serve --model):
    the banner then shows that API's curl and openai client line. `limits`: what one client may take (default: the
    environment's, gateway/client_limits.py)."""
    limits = limits or ClientLimits.resolve()
    memory.keep_large_blocks_mapped()
    home = Home()
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("give --tls-cert and --tls-key together (the certificate and its private key)")
    if tls_cert and tls_key:
        check_own_certificate(tls_cert, tls_key)
    with HomeLock(home) as lock:  # before anything in EMBER_HOME changes
        _logging(home)
        # Tracing is on when EMBER_TRACE_FILE or OTEL_EXPORTER_OTLP_ENDPOINT is set; replicas inherit it.
        if tracing.setup("ember-gateway"):
            logs.follow_spans()
        app = load_app(app_path)
        package = build(app, home)
        if backend == "local":  # replicas run here: their requirements are installed before anything is served
            environments.ensure_for_package(package, lambda line: print(f"  {line}", flush=True), home)
        gateway = Gateway(home, backend_for(backend, home.logs, parked_ram), _limiter(redis_url), routing, limits)
        for warning in [*gateway.restore(), _redis_unanswered(redis_url)]:
            if warning:
                print(f"warning: {warning}", flush=True)
        deployment, _ = gateway.register(package, note=f"ember serve {app_path}")
        restored = sorted(name for name in gateway.deployments if name != deployment.name)
        if restored:
            print(f"Restored apps deployed before: {', '.join(restored)} (ember apps list)", flush=True)
        watcher = None
        if watch:
            redeploy = functools.partial(gateway.deploy, deployed_by="ember serve", note=f"edit of {app_path}")
            watcher = AppWatcher(app_path, package, redeploy, home, lambda line: print(line, flush=True))
            watcher.watch_loaded(app)
        cert, key = (tls_cert, tls_key) if tls_cert else issue_server_cert(home.tls, host, tls_names)
        ca = None if tls_cert else home.ca

        # IPPROTO_TCP, so asyncio sets TCP_NODELAY (Nagle with delayed ACK adds ~40 ms to split writes).
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror as exc:
            raise RuntimeError(f"cannot listen on --host {host} ({exc.strerror}): give an address of this machine, "
                               "e.g. 127.0.0.1, or 0.0.0.0 for all of them") from None
        except OSError as exc:
            raise RuntimeError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another with --port, or "
                               "--port 0 for any free one") from None
        sock.listen(2048)
        port = sock.getsockname()[1]
        local = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
        shown = _reachable(host)
        names = [n for n in certificate_names(tls_cert) if "*" not in n] if tls_cert else []
        if names and shown not in names:
            shown = names[0]  # a URL whose host the certificate names, so clients can verify it
        url = _url(shown, port)
        lock.record(url)
        # On stop, in-flight calls get GRACE seconds, then a JSON 503 (the gateway cuts them); uvicorn's own
        # deadline, a little later, only closes what is left once those replies are written. h11, whose header
        # buffer is capped at the gateway's header limit; connections guarded (gateway/connections.py).
        background = [watcher.run] if watcher else []
        config = uvicorn.Config(create_app(gateway, background), ssl_certfile=str(cert), ssl_keyfile=str(key),
                                log_level="warning", timeout_graceful_shutdown=GRACE + 2,
                                http=connections.protocol(
                                    limits.max_connections, limits.header_timeout, limits.body_timeout),
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES)
        cli_key_id = None
        try:
            cli_key_id = _cli_key(gateway)
            # The CLI on this machine calls the loopback address, which the dev certificate covers; one's own
            # certificate names the host, so the CLI uses the printed URL.
            recorded = url if tls_cert else _url(local, port)
            home.gateway_file.write_text(json.dumps({"url": recorded, "ca": str(ca) if ca else None,
                                                     "pid": os.getpid()}))
            made, replaced = None, []
            if new_key:  # one live key per name: an earlier run's key of this name is revoked; reruns pile up none
                replaced = [k.id for k in gateway.keys.revoke(new_key)]
                made = (new_key, gateway.keys.create(new_key)[1])
            watching = [f"Watching {', '.join(p.name for p in watcher.watched)} for edits (--no-watch to turn off)"
                        ] if watcher else []
            for line in banner.lines(deployment.name, url, ca, tls_cert, home.logs, package, made, replaced, GRACE,
                                     watching, openai_model):
                print(line, flush=True)
            heap.settle()  # what the start built lives as long as the gateway: no collection walks it again
            _Server(config, lambda: gateway.stop_calls(GRACE), limits.header_timeout).run(sockets=[sock])
        finally:
            home.gateway_file.unlink(missing_ok=True)  # the lock says this run owns it
            _forget_cli_key(gateway, cli_key_id)
    return 0
