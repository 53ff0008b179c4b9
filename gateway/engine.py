"""Each LLM function's engine series at the gateway: every hot replica's `/metrics` (the engine's `ember:*` series,
named as vLLM names them) scraped over the node address, summed per function.

Counters and histograms are summed over replicas, and a replica that goes away leaves its last counts behind, so a
function's totals never go backwards when it scales down. Gauges are summed (requests running, waiting), except
fractions (`*_perc`, KV-cache usage), which are averaged over the replicas scraped.
"""
import asyncio
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

import aiohttp

from ember.gateway.deployment import Deployment
from ember.gateway.lifecycle import HOT

PREFIX = "ember:"
SAMPLE = re.compile(r'(ember:[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
TYPE = re.compile(r"# TYPE (ember:\S+) (counter|gauge|histogram)")
SCRAPE_TIMEOUT = 1.0
FRESH = 1.0  # seconds a scrape is reused: a dashboard poll and a Prometheus scrape do not each hit every replica

Series = tuple[str, tuple[tuple[str, str], ...]]  # (metric name, sorted labels)


@dataclass
class Scrape:
    """One replica's engine series as last read."""

    app: str
    function: str
    at: float
    kinds: dict[str, str]  # metric family -> counter | gauge | histogram
    values: dict[Series, float] = field(default_factory=dict)


def parse(text: str) -> tuple[dict[str, str], dict[Series, float]]:
    """The `ember:*` samples of a Prometheus text exposition, and their families' types; other lines are ignored."""
    kinds, values = {}, {}
    for line in text.splitlines():
        if line.startswith("#"):
            if match := TYPE.match(line):
                kinds[match[1]] = match[2]
            continue
        match = SAMPLE.fullmatch(line.strip())
        if match is None:
            continue
        try:
            value = float(match[3])
        except ValueError:
            continue
        labels = tuple(sorted(LABEL.findall(match[2] or "")))
        values[(match[1], labels)] = value
    return kinds, values


def family(name: str, kinds: dict[str, str]) -> tuple[str, str]:
    """The family a sample belongs to and its type: `x_bucket`, `x_sum` and `x_count` are histogram x's."""
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and kinds.get(base) == "histogram":
            return base, "histogram"
    base = name.removesuffix("_total")
    return (base, kinds[base]) if base in kinds else (name, kinds.get(name, "gauge"))


class EngineSeries:
    def __init__(self) -> None:
        self.scrapes: dict[str, Scrape] = {}  # replica id -> its last scrape
        self.retired: dict[tuple[str, str], dict[Series, float]] = defaultdict(lambda: defaultdict(float))
        self.kinds: dict[str, str] = {}
        self.scraped_at = 0.0
        self._lock = asyncio.Lock()

    async def refresh(self, client: aiohttp.ClientSession, deployments: dict[str, Deployment]) -> None:
        """Scrape every hot replica of every ASGI function (at most once a second); fold in the counts of gone ones."""
        async with self._lock:
            if time.monotonic() - self.scraped_at < FRESH:
                return
            replicas = [(unit, r) for d in deployments.values() for unit in d.units.values() if unit.asgi
                        for r in unit.router.replicas.values()]
            hot = [(unit, r) for unit, r in replicas if r.state == HOT]
            await asyncio.gather(*(self._scrape(client, unit.app, unit.name, r) for unit, r in hot))
            alive = {r.id for _, r in replicas}
            for replica_id in [i for i in self.scrapes if i not in alive]:
                self._retire(self.scrapes.pop(replica_id))
            self.scraped_at = time.monotonic()

    async def _scrape(self, client: aiohttp.ClientSession, app: str, function: str, replica) -> None:
        try:
            async with client.get(f"http://{replica.address}/metrics",
                                  timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT)) as reply:
                if reply.status != 200 or not reply.content_type.startswith("text/plain"):
                    return  # an ASGI app that is not an engine, or has no /metrics
                text = await reply.text()
        except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
            return  # a busy or stopping replica: its last scrape stands
        kinds, values = parse(text)
        if values:
            self.kinds.update(kinds)
            self.scrapes[replica.id] = Scrape(app, function, time.monotonic(), kinds, values)

    def _retire(self, scrape: Scrape) -> None:
        retired = self.retired[(scrape.app, scrape.function)]
        for series, value in scrape.values.items():
            if family(series[0], self.kinds)[1] != "gauge":
                retired[series] += value

    def totals(self, app: str, function: str) -> dict[Series, float]:
        """One function's series summed over its replicas (gauges of live ones only; fractions averaged)."""
        fresh = time.monotonic() - 2 * FRESH - SCRAPE_TIMEOUT
        summed: dict[Series, float] = defaultdict(float, self.retired.get((app, function), {}))
        fractions: dict[Series, list[float]] = defaultdict(list)
        for scrape in self.scrapes.values():
            if (scrape.app, scrape.function) != (app, function):
                continue
            for series, value in scrape.values.items():
                kind = family(series[0], self.kinds)[1]
                if kind == "gauge" and scrape.at < fresh:
                    continue  # a replica that stopped answering (parked, stopping) runs nothing now
                if kind == "gauge" and series[0].endswith("_perc"):
                    fractions[series].append(value)
                else:
                    summed[series] += value
        for series, values in fractions.items():
            summed[series] = sum(values) / len(values)
        return dict(summed)

    def functions(self) -> list[tuple[str, str]]:
        return sorted({(s.app, s.function) for s in self.scrapes.values()} | set(self.retired))

    def render(self) -> list[str]:
        by_family: dict[str, list[str]] = defaultdict(list)
        for app, function in self.functions():
            for (name, labels), value in sorted(self.totals(app, function).items(), key=_order):
                text = ",".join([f'app="{app}"', f'function="{function}"'] +
                                [f'{k}="{v}"' for k, v in labels])  # values kept escaped as the engine wrote them
                by_family[family(name, self.kinds)[0]].append(f"{name}{{{text}}} {_number(value)}")
        lines = []
        for name, samples in sorted(by_family.items()):
            lines += [f"# HELP {name} The engine's {name[len(PREFIX):]}, summed over the function's replicas.",
                      f"# TYPE {name} {self.kinds.get(name, 'gauge')}", *samples]
        return lines


def _order(item: tuple[Series, float]) -> tuple:
    """Samples by name and labels, a histogram's buckets by their bound (as text "10.0" would sort before "2.5")."""
    (name, labels), _ = item
    le = dict(labels).get("le")
    return name, [pair for pair in labels if pair[0] != "le"], float(le) if le is not None else 0.0


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) and abs(value) < 2 ** 53 else repr(value)
