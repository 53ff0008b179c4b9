"""The live dashboard at /dashboard, for admin keys.

A login form takes the key once; the gateway answers with a random session token in a cookie (HttpOnly, Secure,
SameSite=Strict, scoped to /dashboard), never the key. The page (static/dashboard.js, no build step) polls
/dashboard/api/state every second and draws its charts as SVG. The history behind the charts is sampled here, at
most once a second, while someone is watching.
"""
import asyncio
import html
import secrets
import time
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response

from ember.gateway.deployment import Unit
from ember.gateway.errors import ApiError
from ember.gateway.keys import ApiKey
from ember.gateway.lifecycle import HOT, PARKED, STARTING
from ember.gateway.metrics import DURATION_BUCKETS

if TYPE_CHECKING:
    from ember.gateway.service import Gateway

PATH = "/dashboard"
COOKIE = "ember_dashboard"
SESSION_TTL = 12 * 3600
STATIC = Path(__file__).parent / "static"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
HISTORY = 600  # samples kept per function: ten minutes at one a second
WINDOW = 10.0  # seconds over which rates and latency quantiles are taken
SAMPLE_EVERY = 1.0
MAX_LOGIN_BODY = 4096
HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
                                      "form-action 'self'; base-uri 'none'"}
TTFT = "ember:time_to_first_token_seconds_bucket"
ITL = "ember:inter_token_latency_seconds_bucket"
KV = "ember:kv_cache_usage_perc"


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of observations given as cumulative (upper bound, count) pairs ending at +Inf, interpolated
    linearly inside the bucket it falls in (as Prometheus' histogram_quantile does); None without observations."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower  # past the last finite bound: the best known is that bound
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def delta(now: list[tuple[float, float]], before: list[tuple[float, float]] | None) -> list[tuple[float, float]]:
    if not before or len(before) != len(now):
        return now
    return [(bound, count - old) for (bound, count), (_, old) in zip(now, before)]


def engine_buckets(totals: dict, name: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets from an engine's summed series (models of one function added together)."""
    counts: dict[float, float] = defaultdict(float)
    for (series, labels), value in totals.items():
        if series == name:
            counts[float(dict(labels)["le"])] += value
    return sorted(counts.items())


@dataclass
class Raw:
    """The cumulative counts a sample is a difference of."""

    t: float
    requests: int
    errors: int
    latency: list[tuple[float, float]]
    ttft: list[tuple[float, float]]
    itl: list[tuple[float, float]]


@dataclass
class FunctionHistory:
    samples: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    raws: deque = field(default_factory=lambda: deque(maxlen=int(WINDOW / SAMPLE_EVERY) + 2))
    starts: deque = field(default_factory=lambda: deque(maxlen=12))  # the last starts and wakes, with breakdowns
    seen: set = field(default_factory=set)  # (replica id, ready_at) already listed in `starts`


class Dashboard:
    def __init__(self, gateway: "Gateway"):
        self.gateway = gateway
        self.sessions: dict[str, tuple[str, float]] = {}  # token -> (key id, expiry)
        self.history: dict[tuple[str, str], FunctionHistory] = defaultdict(FunctionHistory)
        self.sampled_at = 0.0

    # -- sessions
    async def login(self, secret: str) -> str | None:
        key = await asyncio.to_thread(self.gateway.keys.verify, secret.strip()) if secret else None
        if key is None or not key.admin:
            return None
        now = time.time()
        self.sessions = {t: s for t, s in self.sessions.items() if s[1] > now}
        token = secrets.token_urlsafe(32)
        self.sessions[token] = (key.id, now + SESSION_TTL)
        return token

    def session_key(self, request: Request, keys: list[ApiKey]) -> str | None:
        """The admin key id behind the request's cookie, while the session and that key (among `keys`) both live."""
        session = self.sessions.get(request.cookies.get(COOKIE, ""))
        if session is None or session[1] < time.time():
            return None
        live = any(k.id == session[0] and k.admin and k.live(time.time()) for k in keys)
        return session[0] if live else None

    # -- state
    def sample(self) -> None:
        now, wall = time.monotonic(), time.time()
        if now - self.sampled_at < SAMPLE_EVERY:
            return
        self.sampled_at = now
        metrics = self.gateway.metrics
        for deployment in self.gateway.deployments.values():
            for unit in deployment.units.values():
                history = self.history[(unit.app, unit.name)]
                requests = errors = 0
                latency = [0.0] * (len(DURATION_BUCKETS) + 1)
                for (app, name, code), count in metrics.requests.items():
                    if (app, name) == (unit.app, unit.name):
                        requests += count
                        errors += count if code >= 500 or code == 429 else 0
                for (app, name, _), histogram in metrics.durations.items():
                    if (app, name) == (unit.app, unit.name):
                        latency = [a + b for a, b in zip(latency, (n for _, n in histogram.cumulative()))]
                totals = metrics.engines.totals(unit.app, unit.name)
                raw = Raw(wall, requests, errors, list(zip((*DURATION_BUCKETS, float("inf")), latency)),
                          engine_buckets(totals, TTFT), engine_buckets(totals, ITL))
                history.raws.append(raw)
                history.samples.append(self._sample(unit, raw, history.raws[0], totals))
                self._note_starts(unit, history, wall)

    @staticmethod
    def _sample(unit: Unit, raw: Raw, old: Raw, totals: dict) -> dict:
        span = max(raw.t - old.t, SAMPLE_EVERY)
        states = {s: sum(r.state == s for r in unit.router.replicas.values()) for s in (STARTING, HOT, PARKED)}
        latency, ttft, itl = delta(raw.latency, old.latency), delta(raw.ttft, old.ttft), delta(raw.itl, old.itl)
        kv = [v for (name, _), v in totals.items() if name == KV]
        return {"t": round(raw.t, 3), **states, "queue": unit.queue.depth, "in_flight": unit.router.in_flight,
                "slots": unit.router.load, "queue_slots": unit.queue.demand,
                "rps": round((raw.requests - old.requests) / span, 3),
                "eps": round((raw.errors - old.errors) / span, 3),
                "p50": quantile(0.5, latency), "p99": quantile(0.99, latency),
                "ttft_p50": quantile(0.5, ttft), "ttft_p99": quantile(0.99, ttft),
                "itl_p50": quantile(0.5, itl), "itl_p99": quantile(0.99, itl),
                "kv": sum(kv) / len(kv) if kv else None}

    @staticmethod
    def _note_starts(unit: Unit, history: FunctionHistory, wall: float) -> None:
        for replica in unit.router.replicas.values():
            if replica.ready_at is not None and (replica.id, replica.ready_at) not in history.seen:
                history.seen.add((replica.id, replica.ready_at))
                history.starts.append({"t": round(wall, 3), "replica": replica.id, "tier": replica.tier,
                                       "timings": dict(replica.timings)})

    def state(self, keys: list[ApiKey]) -> dict:
        self.sample()
        now = time.monotonic()
        functions = []
        for deployment in self.gateway.deployments.values():
            for unit in deployment.units.values():
                history = self.history[(unit.app, unit.name)]
                replicas = unit.router.replicas.values()
                functions.append({
                    "app": unit.app, "function": unit.name, "kind": unit.kind,
                    "llm": (unit.app, unit.name) in self.gateway.metrics.engines.functions(),
                    "replicas": [r.describe(now) for r in replicas],
                    "by_state": {s: sum(r.state == s for r in replicas) for s in (STARTING, HOT, PARKED)}
                    | {"failed": len(unit.failures)},
                    "queue_depth": unit.queue.depth, "in_flight": unit.router.in_flight,
                    "queue_slots": unit.queue.demand, "slots": unit.router.load,
                    "series": list(history.samples),
                    "cold_starts": {"by_tier": {t: n for (a, f, t), n in self.gateway.metrics.cold_starts.items()
                                                if (a, f) == (unit.app, unit.name)},
                                    "recent": list(reversed(history.starts))},
                    "failures": list(unit.failures),
                    "decisions": [asdict(d) for d in reversed(unit.decisions)][:10],
                    "settings": {k: getattr(unit.spec, k) for k in ("min_replicas", "max_replicas", "max_concurrency",
                                                                    "target_concurrency")},
                })
        return {"time": time.time(), "uptime_s": round(now - self.gateway.started, 1), "window_s": WINDOW,
                "functions": functions, "keys": self.key_rows(keys)}

    def key_rows(self, keys: list[ApiKey]) -> list[dict]:
        metrics, now = self.gateway.metrics, time.monotonic()
        in_flight = metrics.in_flight_by_key()
        rows = []
        for key in keys:
            if not key.live(time.time()):
                continue
            usage = metrics.keys.get(key.id)
            requests, tokens = usage.last_minute(now) if usage else (0, 0)
            rows.append({"id": key.id, "name": key.name, "admin": key.admin,
                         "limits": {"rpm": key.limits.requests_per_minute, "tpm": key.limits.tokens_per_minute,
                                    "concurrency": key.limits.max_concurrent},
                         "used": {"rpm": requests, "tpm": tokens, "concurrency": in_flight[key.id]},
                         "total": {"requests": usage.requests if usage else 0, "tokens": usage.tokens if usage else 0}})
        return rows


def page(name: str, message: str = "") -> str:
    return (STATIC / name).read_text().replace("{{message}}", html.escape(message))


def install(app: FastAPI, gateway: "Gateway") -> Dashboard:
    """The dashboard's routes on the gateway's app."""
    dashboard = Dashboard(gateway)

    async def keys() -> list[ApiKey]:
        return await asyncio.to_thread(gateway.keys.all)  # SQLite stays off the event loop

    @app.get(PATH, include_in_schema=False)
    async def show(request: Request) -> HTMLResponse:
        name = "dashboard.html" if dashboard.session_key(request, await keys()) else "login.html"
        return HTMLResponse(page(name), headers=HEADERS)

    @app.post(f"{PATH}/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        body = await request.body()
        secret = parse_qs(body[:MAX_LOGIN_BODY].decode("utf-8", "replace")).get("key", [""])[0]
        token = await dashboard.login(secret)
        if token is None:
            return HTMLResponse(page("login.html", "That is not a live admin key. Create one with "
                                                   "`ember keys create --name NAME --admin`."),
                                status_code=401, headers=HEADERS)
        reply = RedirectResponse(PATH, status_code=303, headers=HEADERS)
        reply.set_cookie(COOKIE, token, max_age=SESSION_TTL, path=PATH, secure=True, httponly=True, samesite="strict")
        return reply

    @app.post(f"{PATH}/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        dashboard.sessions.pop(request.cookies.get(COOKIE, ""), None)
        reply = RedirectResponse(PATH, status_code=303, headers=HEADERS)
        reply.delete_cookie(COOKIE, path=PATH, secure=True, httponly=True, samesite="strict")
        return reply

    @app.get(f"{PATH}/api/state", include_in_schema=False)
    async def state(request: Request) -> JSONResponse:
        every_key = await keys()
        if dashboard.session_key(request, every_key) is None:
            raise ApiError(401, "unauthorized", "no dashboard session: log in at /dashboard with an admin key")
        await gateway.metrics.engines.refresh(request.app.state.client, gateway.deployments)
        return JSONResponse(dashboard.state(every_key), headers={"Cache-Control": "no-store"})

    @app.get(PATH + "/static/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        if name not in ASSETS:
            raise ApiError(404, "not_found", f"no dashboard asset {name[:100]!r}")
        return FileResponse(STATIC / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

    return dashboard
