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
        self.starts: Counter[tuple[str, str, str, str]] = Counter()  # (app, function, tier, fork or spawn)
        self.start_ms: Counter[tuple[str, str, str]] = Counter()  # (app, function, phase) -> ms summed over starts

    def observe_start(self, app: str, unit: str, tier: str, timings: dict[str, int | str]) -> None:
        """A replica start finished: count it by tier and by how its process began, and add up its phases."""
        self.starts[(app, unit, str(tier), str(timings.get("start", "remote")))] += 1
        for key, value in timings.items():
            if key.endswith("_ms") and isinstance(value, int | float):
                self.start_ms[(app, unit, key.removesuffix("_ms"))] += value

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
        lines += ["# HELP ember_replica_starts_total Replica starts, by tier and by how the process began "
                  "(fork: from the app's fork server; spawn: a fresh process; remote: on a node).",
                  "# TYPE ember_replica_starts_total counter"]
        lines += [f'ember_replica_starts_total{{app="{a}",function="{u}",tier="{t}",start="{h}"}} {n}'
                  for (a, u, t, h), n in sorted(self.starts.items())]
        lines += ["# HELP ember_replica_start_phase_seconds_total Seconds replica starts spent per phase of their "
                  "breakdown (a mean: divide by ember_replica_starts_total).",
                  "# TYPE ember_replica_start_phase_seconds_total counter"]
        lines += [f'ember_replica_start_phase_seconds_total{{app="{a}",function="{u}",phase="{p}"}} {ms / 1000:g}'
                  for (a, u, p), ms in sorted(self.start_ms.items())]
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
