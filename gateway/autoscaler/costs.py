"""What a function's replicas cost to bring back, learned from their own measured starts, wakes and parks.

The policy reads three numbers from it: how long a wake takes, how long a fresh start takes, and
whether a park frees the GPU. From those it decides whether parking pays at all and how long an
idle replica stays hot before it parks. The gateway and the simulator report each measurement in
the `Sample` of the tick that saw it; `decide` folds them in, so the model is part of the policy's
memo and needs no clock or I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

WAKE = "parked"  # the tier name a wake reports; every other tier is a fresh start of a new process
# A park pays while a wake costs at most half a fresh start: slower than that, a parked replica
# saves little latency over a stop and a start, and holds host RAM (or the GPU) for it.
WAKE_PAYS_BELOW = 0.5
# Ski rental: an idle replica stays hot for as long as a park-and-wake round trip costs. That round
# trip is the wake's GPU-seconds plus the wake's delay to the request that finds the replica parked,
# valued here at this many GPU-seconds per second of one request's delay.
DELAY_WORTH_GPU_S = 10.0
PARK_AFTER_FLOOR = 2.0  # never sooner: a request's own think time between turns is often a second or two
LEARNING_WEIGHT = 0.3  # weight of the newest measurement once a few are in (earlier ones fade out)
# parks in a row that failed (each replica stopped instead) before the function parks no more: one may be a fluke,
# two say the backend cannot park it, and each failed park turned a wake into a start
PARK_FAILURES_STOP = 2


@dataclass(frozen=True)
class StartMeasured:
    """One start or wake of a replica: the tier it came from and seconds until it could serve."""

    tier: str
    seconds: float


@dataclass(frozen=True)
class ParkMeasured:
    """One park: the bytes of GPU memory it released (0: the backend keeps the GPU while parked); or refused: the
    replica could not park at all (its driver cannot checkpoint it) and served on; or failed: the park raised
    otherwise, and the replica was stopped to free its GPU."""

    gpu_bytes_freed: int
    refused: bool = False
    failed: bool = False


Measured = StartMeasured | ParkMeasured


@dataclass(frozen=True)
class CostModel:
    """Running estimates for one function; the prior is the backend's ladder, counted as one measurement."""

    wake_s: float = 0.3
    start_s: float = 1.5
    park_frees_gpu: bool = True
    wakes: int = 0
    starts: int = 0
    park_refused: bool = False  # a replica answered that it cannot park: no setting makes parking possible
    park_failures: int = 0  # parks in a row that failed, their replicas stopped; one that works resets it

    def observe(self, measured: Measured) -> CostModel:
        if isinstance(measured, ParkMeasured):
            if measured.failed:   # says nothing of what a park frees
                return replace(self, park_failures=self.park_failures + 1)
            return replace(self, park_frees_gpu=measured.gpu_bytes_freed > 0,
                           park_refused=self.park_refused or measured.refused, park_failures=0)
        if measured.tier == WAKE:
            n = self.wakes + 1
            return replace(self, wake_s=blend(self.wake_s, measured.seconds, n), wakes=n)
        n = self.starts + 1
        return replace(self, start_s=blend(self.start_s, measured.seconds, n), starts=n)

    @property
    def parks_fail(self) -> bool:
        """PARK_FAILURES_STOP parks in a row failed: the function parks no more (until the gateway restarts or the
        function is deployed again, whose cost model starts afresh)."""
        return self.park_failures >= PARK_FAILURES_STOP

    def park_pays(self) -> bool:
        return self.park_frees_gpu and not self.parks_fail and self.wake_s <= WAKE_PAYS_BELOW * self.start_s

    def wake_cost(self) -> float:
        """A park-and-wake round trip in GPU-seconds: the wake's own, and its delay to the request it serves."""
        return self.wake_s * (1 + DELAY_WORTH_GPU_S)

    def park_after(self) -> float:
        """Idle seconds before a hot replica parks, when parking pays: the park-and-wake round trip's cost."""
        return max(PARK_AFTER_FLOOR, self.wake_cost())

    def why_not_park(self) -> str:
        if self.park_refused:
            return "its replicas cannot park here (the driver refused to checkpoint one)"
        if self.parks_fail:
            return (f"its last {self.park_failures} parks failed (each replica was stopped instead; the gateway's "
                    "log says why)")
        if not self.park_frees_gpu:
            return "a park frees no GPU memory on this backend"
        return f"a wake ({self.wake_s:.1f}s) costs about as much as a start ({self.start_s:.1f}s)"


def blend(old: float, new: float, n: int) -> float:
    """The mean of the prior and the first measurements, then an exponentially weighted average."""
    weight = max(1 / (n + 1), LEARNING_WEIGHT)
    return old + weight * (new - old)
