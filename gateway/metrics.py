"""The gateway's Prometheus exposition: requests and how long they took, queue waits, cold starts by tier,
rate-limit rejections, per-key usage, replicas and queues, and each LLM function's engine series summed over its
replicas (engine.py beside this file scrapes them)."""
import time
from collections import Counter, defaultdict, deque

from ember.gateway.deployment import Deployment
from ember.gateway.engine import EngineSeries, escape
from ember.gateway.lifecycle import LIVE, ReplicaState
from ember.gateway.queue import ColdStart
from ember.runtime import logs
from ember.runtime.engine.stats import Histogram

STATES = [s for s in ReplicaState if s in LIVE]
# Seconds from a request's arrival to the end of its reply: a streamed LLM reply can last minutes.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
COLD_START_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0)
USAGE_WINDOW = 60.0  # seconds: per-key usage is shown against per-minute limits


class KeyUsage:
    """One key's requests and tokens: totals for Prometheus, and the last minute's against its limits."""

    def __init__(self, name: str):
        self.name, self.requests, self.tokens = name, 0, 0
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) of each request in the last minute

    def add(self, tokens: int, now: float) -> None:
        self.requests += 1
        self.tokens += tokens
        self.recent.append((now, tokens))
        self.trim(now)

    def trim(self, now: float) -> None:
        while self.recent and self.recent[0][0] < now - USAGE_WINDOW:
            self.recent.popleft()

    def last_minute(self, now: float) -> tuple[int, int]:
        self.trim(now)
        return len(self.recent), sum(tokens for _, tokens in self.recent)


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str, int]] = Counter()
        self.durations: dict[tuple[str, str, int], Histogram] = defaultdict(lambda: Histogram(DURATION_BUCKETS))
        self.queue_waits: dict[tuple[str, str], Histogram] = defaultdict(lambda: Histogram(WAIT_BUCKETS))
        self.cold_starts: Counter[tuple[str, str, str]] = Counter()
        self.starts: Counter[tuple[str, str, str, str]] = Counter()  # (app, function, tier, fork or spawn)
        self.start_ms: Counter[tuple[str, str, str]] = Counter()  # (app, function, phase) -> ms summed over starts
        self.cold_start_seconds: dict[tuple[str, str, str], Histogram] = defaultdict(
            lambda: Histogram(COLD_START_BUCKETS))
        self.rejections: Counter[tuple[str, str, str]] = Counter()  # (app, key id, reason)
        self.retries: Counter[tuple[str, str, str]] = Counter()  # (app, function, reason)
        self.spawned: Counter[tuple[str, str, str]] = Counter()  # (app, function, how it ended)
        self.keys: dict[str, KeyUsage] = {}
        self.live: set[logs.RequestContext] = set()  # requests under way: per-key concurrency
        self.engines = EngineSeries()

    def observe_start(self, app: str, unit: str, tier: str, timings: dict[str, int | str]) -> None:
        """A replica start finished: count it by tier and by how its process began, and add up its phases."""
        self.starts[(app, unit, str(tier), str(timings.get("start", "remote")))] += 1
        for key, value in timings.items():
            if key.endswith("_ms") and isinstance(value, int | float):
                self.start_ms[(app, unit, key.removesuffix("_ms"))] += value

    def observe(self, app: str, unit: str, status: int, cold_start: ColdStart | None,
                queue_wait: float | None = None) -> None:
        """A call's answer (or refusal) is known; its labels go on its log context, so `ended` times the whole reply.
        `queue_wait`: seconds it waited for its slot, when it got one."""
        self.requests[(app, unit, status)] += 1
        logs.annotate(app=app, function=unit, status=status)
        if queue_wait is not None:
            self.queue_waits[(app, unit)].observe(queue_wait)
            logs.annotate(queue_ms=round(queue_wait * 1000, 3))
        if cold_start:
            self.cold_starts[(app, unit, cold_start.tier)] += 1
            self.cold_start_seconds[(app, unit, cold_start.tier)].observe(cold_start.ms / 1000)
            logs.annotate(cold_start=cold_start.tier, cold_start_ms=cold_start.ms)

    def retried(self, app: str, unit: str, reason: str) -> None:
        """A call runs again under its function's `retries=` (reason: function_error or replica_lost)."""
        self.retries[(app, unit, reason)] += 1

    def spawned_call_ended(self, app: str, unit: str, state: str) -> None:
        """A spawned call finished in the background: succeeded, failed or cancelled."""
        self.spawned[(app, unit, state)] += 1

    def started(self, context: logs.RequestContext) -> None:
        self.live.add(context)

    def ended(self, context: logs.RequestContext, status: int, seconds: float) -> None:
        """The reply has ended (a stream: its last byte): time it, and charge its key."""
        self.live.discard(context)
        fields = context.fields
        if "function" not in fields:
            return  # not a call: health checks, admin, the dashboard
        app, unit = fields["app"], fields["function"]
        self.durations[(app, unit, fields["status"])].observe(seconds)
        if "rate_limited" in fields:
            self.rejections[(app, fields.get("key", ""), fields["rate_limited"])] += 1
        if "key" in fields:
            usage = fields.get("usage") if status < 400 else None  # a refused or failed call used no tokens
            usage_tokens = usage.total() if usage is not None else 0
            self.keys.setdefault(fields["key"], KeyUsage(fields["key_name"])).add(usage_tokens, time.monotonic())

    def in_flight_by_key(self) -> Counter[str]:
        return Counter(c.fields["key"] for c in self.live if "key" in c.fields and "function" in c.fields)

    def render(self, deployments: dict[str, Deployment]) -> str:
        lines = _family("ember_requests_total", "counter", "Calls answered, by app, function and status code.")
        lines += [f'ember_requests_total{{app="{a}",function="{u}",code="{c}"}} {n}'
                  for (a, u, c), n in sorted(self.requests.items())]
        lines += _family("ember_request_duration_seconds", "histogram",
                         "Time from a call's arrival to the end of its reply (a stream's last byte).")
        for (a, u, c), histogram in sorted(self.durations.items()):
            lines += _histogram("ember_request_duration_seconds", histogram, f'app="{a}",function="{u}",code="{c}"')
        lines += _family("ember_queue_wait_seconds", "histogram", "Time a call waited in its function's queue.")
        for (a, u), histogram in sorted(self.queue_waits.items()):
            lines += _histogram("ember_queue_wait_seconds", histogram, f'app="{a}",function="{u}"')
        lines += _family("ember_cold_starts_total", "counter", "Calls that waited for a replica start, by tier.")
        lines += [f'ember_cold_starts_total{{app="{a}",function="{u}",tier="{t}"}} {n}'
                  for (a, u, t), n in sorted(self.cold_starts.items())]
        lines += _family("ember_cold_start_seconds", "histogram", "How long calls waited for a replica start, by tier.")
        for (a, u, t), histogram in sorted(self.cold_start_seconds.items()):
            lines += _histogram("ember_cold_start_seconds", histogram, f'app="{a}",function="{u}",tier="{t}"')
        lines += _family("ember_replica_starts_total", "counter", "Replica starts, by tier and by how the process "
                         "began (fork: from the app's fork server; spawn: a fresh process; remote: on a node).")
        lines += [f'ember_replica_starts_total{{app="{a}",function="{u}",tier="{t}",start="{h}"}} {n}'
                  for (a, u, t, h), n in sorted(self.starts.items())]
        lines += _family("ember_replica_start_phase_seconds_total", "counter", "Seconds replica starts spent per "
                         "phase of their breakdown (a mean: divide by ember_replica_starts_total).")
        lines += [f'ember_replica_start_phase_seconds_total{{app="{a}",function="{u}",phase="{p}"}} {ms / 1000:g}'
                  for (a, u, p), ms in sorted(self.start_ms.items())]
        lines += _family("ember_rate_limited_total", "counter",
                         "Calls refused with 429 by a rate limit, by app, key and the limit that refused them.")
        lines += [f'ember_rate_limited_total{{app="{a}",key="{k}",reason="{r}"}} {n}'
                  for (a, k, r), n in sorted(self.rejections.items())]
        lines += _family("ember_call_retries_total", "counter", "Calls run again under their function's retries=, by "
                         "why: the function raised (function_error) or its replica was lost mid-call (replica_lost).")
        lines += [f'ember_call_retries_total{{app="{a}",function="{u}",reason="{r}"}} {n}'
                  for (a, u, r), n in sorted(self.retries.items())]
        lines += _family("ember_spawned_calls_total", "counter", "Spawned calls (Prefer: respond-async) that ended "
                         "in the background, by state: succeeded, failed or cancelled.")
        lines += [f'ember_spawned_calls_total{{app="{a}",function="{u}",state="{s}"}} {n}'
                  for (a, u, s), n in sorted(self.spawned.items())]
        lines += self._render_keys()
        lines += self._render_units(deployments)
        return "\n".join(lines + self.engines.render()) + "\n"

    def _render_keys(self) -> list[str]:
        lines = _family("ember_key_requests_total", "counter", "Calls finished, by API key.")
        lines += _family("ember_key_tokens_total", "counter", "LLM tokens (prompt + completion) used, by API key.")
        lines += _family("ember_key_in_flight", "gauge", "Calls under way, by API key.")
        in_flight = self.in_flight_by_key()
        for key_id, usage in sorted(self.keys.items()):
            labels = f'key="{key_id}",name="{escape(usage.name)}"'
            lines += [f"ember_key_requests_total{{{labels}}} {usage.requests}",
                      f"ember_key_tokens_total{{{labels}}} {usage.tokens}",
                      f"ember_key_in_flight{{{labels}}} {in_flight[key_id]}"]
        return lines

    @staticmethod
    def _render_units(deployments: dict[str, Deployment]) -> list[str]:
        lines = _family("ember_queue_depth", "gauge", "Calls waiting for a replica slot.")
        lines += _family("ember_in_flight", "gauge", "Calls running on replicas.")
        lines += _family("ember_slots_in_use", "gauge",
                         "Replica slots (of max_concurrency) the running calls hold: one per LLM sequence.")
        lines += _family("ember_queue_slots", "gauge", "Replica slots the waiting calls ask for.")
        lines += _family("ember_replicas", "gauge", "Replicas by state.")
        lines += _family("ember_replica_failures", "gauge", "Failed replica starts or crashes remembered.")
        for app, deployment in sorted(deployments.items()):
            for name, unit in sorted(deployment.units.items()):
                labels = f'app="{app}",function="{name}"'
                lines.append(f"ember_queue_depth{{{labels}}} {unit.queue.depth}")
                lines.append(f"ember_in_flight{{{labels}}} {unit.router.in_flight}")
                lines.append(f"ember_slots_in_use{{{labels}}} {unit.router.load}")
                lines.append(f"ember_queue_slots{{{labels}}} {unit.queue.demand}")
                states = Counter(r.state for r in unit.router.replicas.values())
                lines += [f'ember_replicas{{{labels},state="{s}"}} {states[s]}' for s in STATES]
                lines.append(f"ember_replica_failures{{{labels}}} {len(unit.failures)}")
        return lines


def _family(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _histogram(name: str, histogram: Histogram, labels: str) -> list[str]:
    buckets = histogram.cumulative()
    lines = [f'{name}_bucket{{{labels},le="{_bound(b)}"}} {n}' for b, n in buckets]
    return lines + [f"{name}_sum{{{labels}}} {histogram.sum!r}", f"{name}_count{{{labels}}} {buckets[-1][1]}"]


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))
