"""Where a request goes: which unit a path under /{app}/ reaches (a declared function or method, else the
app's ASGI endpoint), and which of that unit's replicas serves it (`Router.pick`: the choice among hot replicas
with a free slot is `choose`, a pure function of the --routing mode)."""
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ember import app
from ember.gateway.affinity import ReplicaLoad, pick
from ember.gateway.lifecycle import HOT, LIVE, PARKED
from ember.gateway.replica import GatewayReplica

if TYPE_CHECKING:
    from ember.gateway.deployment import Unit


APP_NAME = app.APP_NAME  # one rule: ember.App refuses the names the gateway would, checked again here


@dataclass(frozen=True)
class Call:
    unit: str
    method: str


@dataclass(frozen=True)
class Forward:
    unit: str
    path: str  # what the ASGI app sees: /{rest}


def route(units: "dict[str, Unit]", rest: str) -> Call | Forward | None:
    first, _, tail = rest.partition("/")
    unit_name, dot, method = first.partition(".")
    unit = units.get(unit_name)
    if unit is not None and not tail:
        if not dot and unit.kind == "function" and unit.methods == [unit_name]:
            return Call(unit_name, unit_name)
        if dot and method in unit.methods:
            return Call(unit_name, method)
    asgi = next((u.name for u in units.values() if u.asgi), None)
    return Forward(asgi, f"/{rest}") if asgi else None


SESSION = "session:"  # routing keys from X-Session-ID; prompt-prefix keys start "prefix:"
MAX_SESSIONS = 100_000  # sessions remembered per function; the least recently seen are forgotten first


class SessionTable:
    """The replica each recent session was last routed to, so session affinity balances live sessions per
    replica (the load `pick` bounds) rather than calls in flight, which a chat between turns has none of."""

    def __init__(self, capacity: int = MAX_SESSIONS):
        self.capacity = capacity
        self.replica_of: OrderedDict[str, str] = OrderedDict()
        self.count: Counter[str] = Counter()

    def loads(self, key: str, replica_ids: list[str]) -> list[ReplicaLoad]:
        """Sessions per replica, not counting `key` itself: returning to its replica adds nothing."""
        own = self.replica_of.get(key)
        return [ReplicaLoad(r, self.count[r] - (r == own)) for r in replica_ids]

    def record(self, key: str, replica_id: str) -> None:
        old = self.replica_of.pop(key, None)
        if old is not None:
            self.count[old] -= 1
        self.replica_of[key] = replica_id
        self.count[replica_id] += 1
        if len(self.replica_of) > self.capacity:
            _, forgotten = self.replica_of.popitem(last=False)
            self.count[forgotten] -= 1


def choose(mode: str, key: str | None, loads: list[ReplicaLoad], turn: int, adding: int = 1) -> str:
    """Which of the replicas with free slots takes a request adding `adding` to its load. Affinity: the key's
    bounded-load rendezvous choice (session id or prompt prefix), least loaded without a key; round robin: in
    turn."""
    if mode == "round-robin":
        return sorted(r.id for r in loads)[turn % len(loads)]
    if mode == "affinity" and key:
        return pick(key, loads, adding=adding)
    return min(loads, key=lambda r: r.load).id


class Router:
    """One function's replicas, and which of them takes the next call: a hot one with a free slot, by the routing
    mode; when none is, a parked one, woken (waking is the replica's move; the autoscaler may also wake one)."""

    def __init__(self, max_concurrency: int, mode: str = "affinity"):
        self.max_concurrency = max_concurrency
        self.mode = mode  # or "round-robin" / "least-loaded": see `choose`
        self.replicas: dict[str, GatewayReplica] = {}
        self.turn = 0
        self.sessions = SessionTable()

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.replicas.values())

    def add(self, replica: GatewayReplica) -> None:
        self.replicas[replica.id] = replica

    def remove(self, replica: GatewayReplica) -> None:
        self.replicas.pop(replica.id, None)

    def any_live(self) -> bool:
        """Whether a replica may still serve (starting, hot or parked)."""
        return any(r.state in LIVE for r in self.replicas.values())

    @property
    def load(self) -> int:
        """The slots the calls under way hold (see GatewayReplica.load)."""
        return sum(r.load for r in self.replicas.values())

    def pick(self, key: str | None = None, avoid: frozenset[str] = frozenset(),
             slots: int = 1) -> GatewayReplica | None:
        """A replica with `slots` free for a call with affinity `key`, other than `avoid`'s; None when none has."""
        hot = [r for r in self.replicas.values()
               if r.state == HOT and not r.draining and r.load + slots <= self.max_concurrency and r.id not in avoid]
        if hot:
            self.turn += 1
            session = key if self.mode == "affinity" and key is not None and key.startswith(SESSION) else None
            if session is not None:
                loads = self.sessions.loads(session, [r.id for r in hot])
            else:
                loads = [ReplicaLoad(r.id, r.load) for r in hot]
            chosen = choose(self.mode, key, loads, self.turn, slots if session is None else 1)
            if session is not None:
                self.sessions.record(session, chosen)
            return self.replicas[chosen]
        parked = [r for r in self.replicas.values() if r.state == PARKED]
        if parked:
            self.wake(parked[0])
            return parked[0]
        return None

    @staticmethod
    def wake(replica: GatewayReplica) -> None:
        """Back into routing: a draining replica is still hot, so only its drain is undone; a parked one wakes (on
        the local CPU backend a parked replica is a live process merely marked parked, so that is all it takes)."""
        if replica.draining:
            replica.undrain()
        else:
            replica.wake()
