"""Prometheus text exposition of request counts, cold starts, queue depth and replicas."""
from collections import Counter

from ember.gateway.deployment import Deployment
from ember.gateway.queue import ColdStart
from ember.gateway.replica import HOT, PARKED, STARTING

STATES = (STARTING, HOT, PARKED)


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str, int]] = Counter()
        self.cold_starts: Counter[tuple[str, str, str]] = Counter()

    def observe(self, app: str, unit: str, status: int, cold_start: ColdStart | None) -> None:
        self.requests[(app, unit, status)] += 1
        if cold_start:
            self.cold_starts[(app, unit, cold_start.tier)] += 1

    def render(self, deployments: dict[str, Deployment]) -> str:
        lines = ["# HELP ember_requests_total Calls answered, by app, function and status code.",
                 "# TYPE ember_requests_total counter"]
        lines += [f'ember_requests_total{{app="{a}",function="{u}",code="{c}"}} {n}' for (a, u, c), n in sorted(self.requests.items())]
        lines += ["# HELP ember_cold_starts_total Calls that waited for a replica start, by tier.",
                  "# TYPE ember_cold_starts_total counter"]
        lines += [f'ember_cold_starts_total{{app="{a}",function="{u}",tier="{t}"}} {n}' for (a, u, t), n in sorted(self.cold_starts.items())]
        lines += ["# HELP ember_queue_depth Calls waiting for a replica slot.", "# TYPE ember_queue_depth gauge",
                  "# HELP ember_in_flight Calls running on replicas.", "# TYPE ember_in_flight gauge",
                  "# HELP ember_replicas Replicas by state.", "# TYPE ember_replicas gauge",
                  "# HELP ember_replica_failures Failed replica starts or crashes remembered.", "# TYPE ember_replica_failures gauge"]
        for app, deployment in sorted(deployments.items()):
            for name, unit in sorted(deployment.units.items()):
                labels = f'app="{app}",function="{name}"'
                lines.append(f"ember_queue_depth{{{labels}}} {unit.queue.depth}")
                lines.append(f"ember_in_flight{{{labels}}} {unit.queue.in_flight}")
                states = Counter(r.state for r in unit.queue.replicas.values())
                lines += [f'ember_replicas{{{labels},state="{s}"}} {states[s]}' for s in STATES]
                lines.append(f"ember_replica_failures{{{labels}}} {len(unit.failures)}")
        return "\n".join(lines) + "\n"
