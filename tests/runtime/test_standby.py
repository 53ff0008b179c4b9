"""GPU standbys (on unless EMBER_GPU_STANDBY=0): a GPU a forked replica gave back gets a child of its unit, forked
and with CUDA initialised, which becomes the next replica there; a replica of another unit on that GPU ends it
first. Real processes on a machine without a GPU: the supervisor is given one GPU id, which torch here cannot see,
so the standby's CUDA work is skipped and the hand-over is what is tested (on the GPU machine, with GPU 0, it is
done)."""
import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch

from ember.gateway.backends.local import LocalBackend
from ember.home import Home
from ember.package import build, load_app
from ember.runtime.supervisor import WorkerProcess

from .test_forkserver import Node

APP = Path(__file__).parent / "apps" / "standby.py"


def children(pid: int) -> set[int]:
    """The pids whose parent is `pid`."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{pid}\n" in status:
                found.add(int(entry))
    return found


def run(test, tmp_path, monkeypatch, standby: bool = True):
    monkeypatch.setenv("EMBER_GPU_STANDBY", "1" if standby else "0")
    package = build(load_app(APP), Home(tmp_path / "home"))

    async def go():
        backend = LocalBackend(tmp_path, parked_ram=0, gpus=["0"], fork=True)   # the gateway's, for its status
        supervisor = backend.workers
        workers: list[WorkerProcess] = []

        async def start(unit: str) -> WorkerProcess:
            worker = WorkerProcess(f"{unit}-{len(workers)}", "standby", unit, tmp_path / f"{unit}-{len(workers)}.log")
            workers.append(worker)
            assert await supervisor.start(worker, package, load_app(APP).units[unit].spec), worker.error
            return worker

        try:
            await test(supervisor, start, backend)
        finally:
            await asyncio.gather(*(supervisor.stop(w, grace=5) for w in workers))
            await supervisor.close()

    asyncio.run(asyncio.wait_for(go(), 120))


async def standby_of(supervisor, templates_before: set[int]) -> int:
    """The pid of the one standby the fork server's templates hold (once it is forked)."""
    server = supervisor.forkservers["standby"].process.pid
    for _ in range(200):
        waiting = {kid for template in children(server) for kid in children(template)} - templates_before
        if waiting:
            [pid] = waiting
            return pid
        await asyncio.sleep(0.05)
    raise AssertionError("no standby was forked")


async def kept_standby(supervisor, start) -> int:
    """A replica of `first` started and stopped: the pid of the standby its GPU then gets."""
    await supervisor.stop(await start("first"), grace=5)
    return await standby_of(supervisor, set())


def test_the_next_replica_on_a_gpu_is_its_units_standby(tmp_path, monkeypatch):
    async def test(supervisor, start, backend):
        first = await start("first")
        assert first.timings["start"] == "fork" and (await Node.call(first, "first"))["devices"] == "0"
        assert "standbys" not in backend.prepared("standby")
        await supervisor.stop(first, grace=5)
        assert supervisor.standbys["0"][:2] == ("standby", "first")
        assert backend.prepared("standby")["standbys"] == {"0": "first"}   # in `ember status`
        waiting = await standby_of(supervisor, set())
        again = await start("first")
        assert again.timings["start"] == "standby" and "fork_ms" in again.timings, again.timings
        result = await Node.call(again, "first")
        assert result == {"pid": waiting, "devices": "0"} and again.process.pid == waiting
        assert "0" not in supervisor.standbys   # taken over, not kept
        if torch.cuda.is_available():   # on the GPU machine: CUDA was initialised before the request came
            assert again.timings["standby_cuda_ms"] > again.timings.get("cuda_init_ms", 0), again.timings
        await supervisor.stop(again, grace=5)   # its exit is reported as any replica's
        assert again.process.returncode is not None

    run(test, tmp_path, monkeypatch)


def test_a_replica_of_another_unit_on_the_gpu_ends_the_standby(tmp_path, monkeypatch):
    async def test(supervisor, start, backend):
        waiting = await kept_standby(supervisor, start)
        other = await start("second")
        assert other.timings["start"] == "fork" and (await Node.call(other, "second"))["pid"] != waiting
        for _ in range(200):   # it read EOF and exited, and its template reaped it
            if not Path(f"/proc/{waiting}").exists():
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the standby {waiting} of 'first' outlived a replica of 'second' on its GPU")

    run(test, tmp_path, monkeypatch)


def test_a_standby_that_was_killed_leaves_the_next_start_a_plain_fork(tmp_path, monkeypatch):
    """Started at once after the kill: with a CUDA context the killed standby takes seconds to exit, and the
    template must not hand the request to a process on its way out."""
    async def test(supervisor, start, backend):
        waiting = await kept_standby(supervisor, start)
        os.kill(waiting, signal.SIGKILL)
        again = await start("first")
        assert again.timings["start"] == "fork" and (await Node.call(again, "first"))["devices"] == "0"
        assert not supervisor.standbys   # forgotten, not left to hold memory beside the new replica

    run(test, tmp_path, monkeypatch)


def test_without_the_setting_no_standby_is_kept(tmp_path, monkeypatch):
    async def test(supervisor, start, backend):
        first = await start("first")
        await supervisor.stop(first, grace=5)
        assert not supervisor.standbys
        assert (await start("first")).timings["start"] == "fork"

    run(test, tmp_path, monkeypatch, standby=False)


@pytest.mark.parametrize("message", [None, b'{"type": "Exited", "code": 0}'], ids=["dropped", "not-a-request"])
def test_a_standby_that_gets_no_request_exits_quietly(message):
    """run_standby whose template closes its socket (a drop), or sends what is not a fork request, returns 0
    without serving."""
    import socket

    from ember.runtime.forkserver import run_standby

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if message is not None:
        ours.send(message)
    ours.close()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    saved = dict(os.environ)
    try:
        assert run_standby(None, None, env, theirs) == 0
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_dying_tells_a_process_that_can_take_a_request_from_one_on_its_way_out():
    import subprocess

    from ember.runtime.forkserver import dying

    process = subprocess.Popen(["sleep", "60"])
    try:
        assert not dying(process.pid) and not dying(os.getpid())
        os.kill(process.pid, signal.SIGSTOP)   # stopped: the kill stays pending or it is exiting, never servable
        os.kill(process.pid, signal.SIGKILL)
        assert dying(process.pid)
    finally:
        process.kill()
        process.wait()
    assert dying(process.pid)   # reaped: no /proc entry
