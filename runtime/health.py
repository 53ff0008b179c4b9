"""Whether this replica process can still serve. A part that cannot go on (an LLM engine whose step loop died, a
call that overran its timeout in a thread nothing can stop) says so here once; the worker then reports itself
unhealthy and exits, and the gateway's autoscaler starts a fresh replica in its place."""
import threading
from collections.abc import Callable

_lock = threading.Lock()
_listeners: list[Callable[[str], None]] = []
reason: str | None = None  # why this process cannot serve any more; None while it can


def fail(why: str) -> None:
    """Mark the process unable to serve (the first reason wins); callable from any thread."""
    global reason
    with _lock:
        if reason is not None:
            return
        reason = why
        listeners = list(_listeners)
    for listener in listeners:
        listener(why)


def on_failure(listener: Callable[[str], None]) -> None:
    """Call `listener(reason)` once the process is marked failed (at once if it is already), from the failing thread."""
    with _lock:
        _listeners.append(listener)
        why = reason
    if why is not None:
        listener(why)
