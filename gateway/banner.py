"""What `ember serve` prints once it listens: where it serves, how to trust it, and commands that work when pasted."""
import json
import shlex
from collections.abc import Sequence
from pathlib import Path

from ember.package import read_manifest

EXAMPLE_VALUES = {"int": 3, "float": 3.0, "str": "world", "bool": True, "list": ["hello world"], "dict": {}}
LAST_LINE = "Stop with Ctrl-C or SIGTERM"  # the banner's end (tests read up to it)


def example_call(package: Path, openai_model: tuple[str, str] | None = None) -> tuple[str, dict | None, str | None]:
    """(path under the app, JSON body or None for a GET, the OpenAI base path or None) of a call worth printing: for
    a model served with --model, its OpenAI API; else the first declared function or method; else what an ASGI app
    declared with @ember.asgi_app(try_path=..., openai_base=...)."""
    if openai_model is not None:
        model, kind = openai_model
        if kind == "embeddings":
            return "v1/embeddings", {"model": model, "input": ["A cat sits on the mat."]}, "/v1"
        return "v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                                       "max_tokens": 32}, "/v1"
    units = read_manifest(package)["units"]
    for name, unit in units.items():
        for method in unit["methods"]:
            body = {p: EXAMPLE_VALUES.get(kind) for p, kind in unit["params"][method].items()}
            return (method if unit["kind"] == "function" else f"{name}.{method}"), body, None
    for unit in units.values():
        if unit.get("try_it"):
            try_it = unit["try_it"]
            path = try_it["path"] or (f"{try_it['openai_base']}/models" if try_it["openai_base"] else None)
            return (path or "").lstrip("/"), try_it["body"], try_it["openai_base"]
    return "", None, None


def curl(url: str, secret: str, ca: Path | None, body: dict | None) -> str:
    """A curl to paste; the key in double quotes, so "$EMBER_KEY" expands (a real key is [A-Za-z0-9_-])."""
    words = ["curl"] + ([f"--cacert {shlex.quote(str(ca))}"] if ca else [])
    words.append(f'-H "Authorization: Bearer {secret}"')
    if body is not None:
        words += ["-H 'Content-Type: application/json'", f"-d {shlex.quote(json.dumps(body))}"]
    return " ".join(words + [shlex.quote(url)])


def lines(app: str, url: str, ca: Path | None, own_cert: str | None, logs: Path, package: Path,
          key: tuple[str, str] | None, replaced: list[str], grace: float, notes: Sequence[str] = (),
          openai_model: tuple[str, str] | None = None) -> list[str]:
    """The banner: URL, trust, logs, then a curl (with the new key, or "$EMBER_KEY" for an OpenAI API) and, for an
    OpenAI-speaking app, what the openai client needs; `notes` go last, before how to stop."""
    out = [f"Ember is serving app {app!r} at {url}"]
    out.append(f"CA certificate: {ca}" if ca else f"Certificate: {own_cert} (clients verify it with their own trust "
                                                  "store)")
    out.append(f"Logs: {logs} (ember logs; ember status for replicas)")
    if ca:
        out.append(f"Python clients (httpx, openai) trust it with: export SSL_CERT_FILE={ca}")
    path, body, openai_base = example_call(package, openai_model)
    secret = "$EMBER_KEY"
    if key is not None:
        name, secret = key
        was = f"; it replaces key {', '.join(replaced)} of that name, now revoked" if replaced else ""
        out.append(f"API key {name!r} (shown once{was}): {secret}")
    if key is not None or openai_base:
        if path or body is not None:
            out += ["Try it:", "  " + curl(f"{url}/{app}/{path}", secret, ca, body)]
        else:
            out.append(f'Call the paths the app serves under {url}/{app}/ with: -H "Authorization: Bearer {secret}"')
    if openai_base:
        api_key = f'"{secret}"' if key else 'os.environ["EMBER_KEY"]'
        client = f', http_client=httpx.Client(verify="{ca}")' if ca else ""
        out.append(f'  openai.OpenAI(base_url="{url}/{app}{openai_base}", api_key={api_key}{client})')
        env = {"OPENAI_BASE_URL": f"{url}/{app}{openai_base}", "OPENAI_API_KEY": secret}
        env |= {"SSL_CERT_FILE": str(ca)} if ca else {}
        out.append("  or, for openai.OpenAI() with no arguments: export "
                   + " ".join(f'{k}="{v}"' for k, v in env.items()))
    if key is None:
        out.append("Create an API key with: ember keys create --name NAME (or serve with --new-key NAME)")
    out += notes
    out.append(f"{LAST_LINE}; calls still running get {grace:g} s to finish.")
    return out
