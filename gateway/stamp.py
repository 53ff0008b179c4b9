"""Headers every reply to a call carries: its replica, its rate-limit state, and for a call that waited for a start
the tier, the wait and the start's breakdown."""
from starlette.responses import Response

from ember.gateway import proxy
from ember.gateway.queue import Lease
from ember.runtime.tiers import breakdown_header


def stamp(response: Response, lease: Lease, limits: dict[str, str]) -> Response:
    extra = {"x-ember-replica": lease.replica.id} | {k.lower(): v for k, v in limits.items()}
    if lease.cold_start:
        extra["x-ember-cold-start"] = lease.cold_start.header()
        if lease.replica.timings and lease.replica.tier != "parked":
            extra["x-ember-start-breakdown"] = breakdown_header(lease.replica.timings)
    if isinstance(response, proxy.Relay):
        response.raw_headers += [(k.encode(), v.encode()) for k, v in extra.items()]
    else:
        response.headers.update(extra)
    return response
