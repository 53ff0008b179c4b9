"""`ember serve`: gateway, autoscaler and local backend for one app, in the foreground, over HTTPS."""
import contextlib
import json
import logging
import os
import socket

import uvicorn

from ember.gateway import connections
from ember.gateway.backends import backend_for
from ember.gateway.header_limit import MAX_HEADER_BYTES
from ember.gateway.ratelimit import MemoryLimiter, RedisLimiter
from ember.gateway.reload import AppWatcher
from ember.gateway.server import create_app
from ember.gateway.service import Gateway
from ember.gateway.tls import issue_server_cert
from ember.home import Home
from ember.package import build, load_app, read_manifest
from ember.runtime import logs, tracing

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


def _cli_key(gateway: Gateway) -> None:
    """A fresh admin key for the CLI on this machine, replacing the previous run's."""
    gateway.keys.revoke(CLI_KEY_NAME)
    _, secret = gateway.keys.create(CLI_KEY_NAME, admin=True)
    path = gateway.home.cli_key_file
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(secret + "\n")


def _limiter(redis_url: str | None):
    """Rate-limit state in Redis when gateways share it (--redis or EMBER_REDIS_URL), else in this process."""
    redis_url = redis_url or os.environ.get("EMBER_REDIS_URL")
    if not redis_url:
        return MemoryLimiter()
    import redis.asyncio

    return RedisLimiter(redis.asyncio.Redis.from_url(redis_url))


EXAMPLE_VALUES = {"int": 3, "float": 3.0, "str": "world", "bool": True, "list": ["hello world"], "dict": {}}


def _example_call(package) -> tuple[str, str]:
    """The first declared function or method and a JSON body for it, for the printed curl."""
    for name, unit in read_manifest(package)["units"].items():
        for method in unit["methods"]:
            params = unit["params"][method]
            body = json.dumps({p: EXAMPLE_VALUES.get(kind) for p, kind in params.items()})
            return (method if unit["kind"] == "function" else f"{name}.{method}"), body
    return "", "{}"


def _example_openai_call(model: str, kind: str) -> tuple[str, str]:
    if kind == "embeddings":
        return "v1/embeddings", json.dumps({"model": model, "input": ["A cat sits on the mat."]})
    return "v1/chat/completions", json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                                              "max_tokens": 32})


def serve(app_path: str, host: str = "127.0.0.1", port: int = 8443, new_key: str | None = None,
          backend: str = "local", parked_ram: str | None = None, redis_url: str | None = None, routing: str = "affinity",
          watch: bool = True, openai_model: tuple[str, str] | None = None) -> int:
    """`openai_model`: (name, "chat" or "embeddings") when the app serves a model's OpenAI API (ember serve --model):
    the banner then shows that API's curl and openai client line."""
    home = Home()
    _logging(home)
    if tracing.setup("ember-gateway"):  # on when EMBER_TRACE_FILE or OTEL_EXPORTER_OTLP_ENDPOINT is set; replicas inherit it
        logs.follow_spans()
    app = load_app(app_path)
    package = build(app, home)
    gateway = Gateway(home, backend_for(backend, home.logs, parked_ram), _limiter(redis_url), routing)
    deployment, _ = gateway.register(package)
    watcher = None
    if watch:
        watcher = AppWatcher(app_path, package, gateway.deploy, home, lambda line: print(line, flush=True))
        watcher.watch_loaded(app)
    cert, key = issue_server_cert(home.tls, host)
    _cli_key(gateway)

    # IPPROTO_TCP, so asyncio sets TCP_NODELAY (Nagle with delayed ACK adds ~40 ms to split writes).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another with --port, or --port 0 for any free one") from None
    sock.listen(2048)
    port = sock.getsockname()[1]
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"https://{f'[{shown}]' if ':' in shown else shown}:{port}"
    home.gateway_file.write_text(json.dumps({"url": url, "ca": str(home.ca), "pid": os.getpid()}))

    print(f"Ember is serving app {deployment.name!r} at {url}", flush=True)
    print(f"CA certificate: {home.ca}", flush=True)
    print(f"Logs: {home.logs} (ember logs; ember status for replicas)", flush=True)
    path, body = _example_call(package) if openai_model is None else _example_openai_call(*openai_model)
    secret = "$EMBER_KEY"
    if new_key:
        _, secret = gateway.keys.create(new_key)
        print(f"API key {new_key!r} (shown once): {secret}", flush=True)
    if new_key or openai_model:
        print(f"Try it:\n  curl --cacert {home.ca} -H \"Authorization: Bearer {secret}\" -H 'Content-Type: application/json' "
              f"-d '{body}' {url}/{deployment.name}/{path}", flush=True)
    if openai_model:
        api_key = f'"{secret}"' if new_key else 'os.environ["EMBER_KEY"]'
        print(f'  openai.OpenAI(base_url="{url}/{deployment.name}/v1", api_key={api_key}, '
              f'http_client=httpx.Client(verify="{home.ca}"))', flush=True)
    if not new_key:
        print("Create an API key with: ember keys create --name NAME", flush=True)
    if watcher is not None:
        print(f"Watching {', '.join(p.name for p in watcher.watched)} for edits (--no-watch to turn off)", flush=True)

    # On stop, in-flight calls get GRACE seconds; idle TLS keep-alive clients would otherwise hold it for 30 s.
    # h11, whose header buffer is capped at the gateway's header limit; connections guarded (gateway/connections.py).
    background = [watcher.run] if watcher else []
    config = uvicorn.Config(create_app(gateway, background), ssl_certfile=str(cert), ssl_keyfile=str(key),
                            log_level="warning", timeout_graceful_shutdown=GRACE, http=connections.protocol(),
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    try:
        uvicorn.Server(config).run(sockets=[sock])  # uvicorn's loop factory: uvloop where installed
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError):
            if json.loads(home.gateway_file.read_text()).get("pid") == os.getpid():
                home.gateway_file.unlink()
    return 0
