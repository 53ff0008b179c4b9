"""The fork server: replicas forked from a process that imported the package and ran the snap=True hooks once,
and every way back to a plain spawn (a dead fork server, a new package, a hook that touched CUDA). Real processes."""
import asyncio
import logging
import os
import shutil
import signal
from pathlib import Path

import httpx
import pytest

from ember.home import Home
from ember.package import build, load_app
from ember.runtime.supervisor import Supervisor, WorkerProcess
from ember.runtime.worker import CONTROL_HEADER

APP = Path(__file__).parent / "apps" / "forking.py"


@pytest.fixture
def package(tmp_path):
    return build(load_app(APP), Home(tmp_path / "home"))


class Node:
    """A supervisor with its replicas, stopped (fork servers too) when the test ends."""

    def __init__(self, logs: Path, fork: bool = True):
        self.logs, self.supervisor, self.workers = logs, Supervisor([], logging.getLogger("test"), fork), []

    async def start(self, package: Path, unit: str) -> WorkerProcess:
        worker = WorkerProcess(f"{unit.lower()}-{len(self.workers)}", "forking", unit,
                               self.logs / f"{unit}-{len(self.workers)}.log")
        self.workers.append(worker)
        spec = load_app(APP).units[unit].spec
        assert await self.supervisor.start(worker, package, spec), worker.error
        return worker

    @staticmethod
    async def call(worker: WorkerProcess, method: str) -> dict:
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"http://127.0.0.1:{worker.port}/__ember__/call/{method}", json={},
                                      headers={CONTROL_HEADER: worker.control_secret})
        assert reply.status_code == 200, reply.text
        return reply.json()["result"]

    def forkserver_pid(self) -> int:
        return self.supervisor.forkservers["forking"].process.pid

    async def close(self) -> None:
        await asyncio.gather(*(self.supervisor.stop(w, grace=5) for w in self.workers))
        await self.supervisor.close()


def run(test, tmp_path, fork: bool = True):
    async def go():
        node = Node(tmp_path, fork)
        try:
            await test(node)
        finally:
            await node.close()

    asyncio.run(asyncio.wait_for(go(), 120))


def test_a_replica_forked_after_torch_was_imported_does_not_import_it_again(package, tmp_path):
    async def test(node: Node):
        first = await node.start(package, "imported_in")
        second = await node.start(package, "imported_in")
        for worker in (first, second):
            result = await node.call(worker, "imported_in")
            assert result["imported_in"] == node.forkserver_pid() != result["pid"] == worker.process.pid
            assert worker.timings["start"] == "fork" and "fallback" not in worker.timings
            assert worker.timings["import_ms"] < 100, worker.timings  # the fork server imported torch, not it
            assert worker.tier == "node-warm"
        assert "forkserver_wait_ms" in first.timings  # the first start waited for the fork server's imports
        assert "forkserver_wait_ms" not in second.timings
        sockets = os.path.dirname(node.supervisor.forkservers["forking"].socket_path)
        await node.close()
        assert not os.path.exists(sockets)  # the fork servers' socket directory goes with them

    run(test, tmp_path)


def test_a_spawned_replica_pays_for_its_imports(package, tmp_path):
    async def test(node: Node):
        worker = await node.start(package, "imported_in")
        result = await node.call(worker, "imported_in")
        assert result["imported_in"] == result["pid"] == worker.process.pid
        assert worker.timings["start"] == "spawn" and worker.timings["import_ms"] > 100, worker.timings

    run(test, tmp_path, fork=False)


def test_snap_hooks_run_once_in_the_fork_server_and_every_replica_sees_their_state(package, tmp_path, monkeypatch):
    snaps = tmp_path / "snaps.log"
    monkeypatch.setenv("FORKING_SNAP_LOG", str(snaps))

    async def test(node: Node):
        workers = [await node.start(package, "Snapped") for _ in range(3)]
        results = [await node.call(w, "where") for w in workers]
        [built_in] = {r["built_in"] for r in results}  # one instance, built once, in one process
        assert snaps.read_text().split() == [str(built_in)]
        assert built_in not in {r["pid"] for r in results} | {node.forkserver_pid()}  # the unit's template
        assert sorted(r["pid"] for r in results) == sorted(w.process.pid for w in workers)
        assert all(r["sum"] == 499500 for r in results)
        assert "snap_ms" not in workers[1].timings  # the template was ready: later starts do not wait for it
        templates = node.supervisor.forkservers["forking"].status()["templates"]
        assert templates["Snapped"]["snap_ms"] >= 0 and "refused" not in templates["Snapped"]
        for worker in workers:  # phases the hooks reported join the breakdown: each replica's own only
            assert worker.timings["connect_ms"] == 2 and worker.timings["cache"] == "cold"
            assert "table_ms" not in worker.timings
        # the HTTP server's modules came with the fork: a replica's first reply imports none of them
        assert await node.call(workers[2], "late_imports") == []

    run(test, tmp_path)


def test_a_replicas_collector_walks_none_of_what_its_start_built_forked_or_spawned(package, tmp_path):
    """A full collection walks every object it tracks, with the event loop and the engine loop stopped: what the
    start built (modules, the snapped state, the app) is frozen, in the template before it forks (a collection in a
    replica would otherwise write to the shared pages) and in the replica before it serves."""
    async def test(node: Node):
        forked = await node.start(package, "Snapped")
        spawned_node = Node(tmp_path / "spawned", fork=False)
        spawned_node.logs.mkdir()
        try:
            spawned = await spawned_node.start(package, "Snapped")
            assert spawned.timings["start"] == "spawn"
            for worker, on in ((forked, node), (spawned, spawned_node)):
                heap = await on.call(worker, "heap")
                assert heap["frozen"] > 50_000, heap   # torch and the HTTP stack: ~200,000
                assert not heap["instance_walked"] and heap["new_walked"], heap
        finally:
            await spawned_node.close()

    run(test, tmp_path)


def test_a_dead_fork_server_falls_back_to_a_spawn_says_so_and_is_restarted(package, tmp_path):
    async def test(node: Node):
        forked = await node.start(package, "imported_in")
        dead = node.forkserver_pid()
        os.kill(dead, signal.SIGKILL)
        await node.supervisor.forkservers["forking"].process.wait()
        spawned = await node.start(package, "imported_in")
        assert spawned.timings["start"] == "spawn"
        assert "exited with code -9" in spawned.timings["fallback"] and "restarted" in spawned.timings["fallback"]
        again = await node.start(package, "imported_in")
        assert again.timings["start"] == "fork" and node.forkserver_pid() != dead
        # the replica forked by the dead server still serves, and still ends when stopped
        assert (await node.call(forked, "imported_in"))["pid"] == forked.process.pid
        await node.supervisor.stop(forked, grace=5)
        assert forked.process.returncode is not None

    run(test, tmp_path)


def test_a_new_package_replaces_the_fork_server_and_old_replicas_serve_on(tmp_path):
    source = tmp_path / "forking.py"
    shutil.copy(APP, source)
    old = build(load_app(source), Home(tmp_path / "home"))
    source.write_text(APP.read_text() + "\nVERSION = 2\n")
    new = build(load_app(source), Home(tmp_path / "home"))
    assert old != new

    async def test(node: Node):
        before = await node.start(old, "imported_in")
        old_server = node.supervisor.forkservers["forking"].process
        after = await node.start(new, "imported_in")
        assert await old_server.wait() is not None and node.forkserver_pid() != old_server.pid
        assert (await node.call(after, "imported_in"))["imported_in"] == node.forkserver_pid()
        assert (await node.call(before, "imported_in"))["imported_in"] == old_server.pid

    run(test, tmp_path)


def test_a_snap_hook_that_touches_cuda_makes_its_unit_spawn_with_the_reason(package, tmp_path, monkeypatch):
    monkeypatch.setenv("FORKING_TOUCH_CUDA", "1")

    async def test(node: Node):
        snapped = await node.start(package, "Snapped")
        assert snapped.timings["start"] == "spawn"
        assert "the snap=True hooks of Snapped initialised CUDA" in snapped.timings["fallback"]
        assert "@ember.enter(snap=False)" in snapped.timings["fallback"]
        result = await node.call(snapped, "where")
        assert result["built_in"] == result["pid"]  # the spawned replica ran its own snap=True hooks
        # the fork server itself is unharmed: another unit of the package still forks
        other = await node.start(package, "imported_in")
        assert other.timings["start"] == "fork"

    run(test, tmp_path)


def test_what_makes_a_process_unfit_to_fork_is_named(monkeypatch):
    import threading

    import torch

    from ember.runtime.forkserver import fork_hazard

    monkeypatch.setattr(torch.cuda, "_initialized", True)  # what torch's lazy CUDA init leaves behind
    assert fork_hazard("the hooks").startswith("the hooks initialised CUDA")
    monkeypatch.setattr(torch.cuda, "_initialized", False)
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="step-loop")
    worker.start()
    try:
        hazard = fork_hazard("the hooks")  # (pytest may run threads of its own: only ours is asserted)
        assert hazard.startswith("the hooks left threads running (") and "step-loop" in hazard
    finally:
        stop.set()
        worker.join()


def test_messages_cross_the_socket_as_typed_values_with_descriptors():
    import socket

    from ember.runtime import forkserver

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read, write = os.pipe()
    with ours, theirs:
        forkserver.send(ours, forkserver.ForkRequest("Chat", {"CUDA_VISIBLE_DEVICES": "3"}), [write])
        message, fds = forkserver.receive(theirs, 3)
        assert message == forkserver.ForkRequest("Chat", {"CUDA_VISIBLE_DEVICES": "3"}) and len(fds) == 1
        os.write(fds[0], b"x")  # the descriptor that arrived is the pipe's write end
        assert os.read(read, 1) == b"x"
        ours.close()
        assert forkserver.receive(theirs) == (None, [])  # the other end closed
    forkserver.close_fds([read, write, *fds])


def test_a_deploy_builds_every_units_template_before_its_first_start(package, tmp_path, monkeypatch):
    snaps = tmp_path / "snaps.log"
    monkeypatch.setenv("FORKING_SNAP_LOG", str(snaps))

    async def test(node: Node):
        node.supervisor.prepare("forking", package, node.logs)  # what a deploy does
        server = node.supervisor.forkservers["forking"]
        for _ in range(300):
            if server.status().get("templates", {}).keys() >= {"Snapped", "imported_in"}:
                break
            await asyncio.sleep(0.1)
        assert server.status()["state"] == "ready", server.status()
        assert server.status()["templates"]["Snapped"]["snap_ms"] >= 0
        assert len(snaps.read_text().split()) == 1  # the snap=True hooks ran at deploy, with no replica yet
        worker = await node.start(package, "Snapped")
        assert "snap_ms" not in worker.timings and "forkserver_wait_ms" not in worker.timings, worker.timings
        assert (await node.call(worker, "where"))["built_in"] == int(snaps.read_text().split()[0])

    run(test, tmp_path)


def test_a_module_is_preloaded_only_when_importing_it_leaves_the_fork_server_fit_to_fork(tmp_path, monkeypatch):
    from ember.runtime import forkserver

    (tmp_path / "calm_module.py").write_text("VALUE = 1\n")
    (tmp_path / "threading_module.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert forkserver._safe_to_import("calm_module")
    assert not forkserver._safe_to_import("threading_module")  # a thread would not survive the fork
    assert not forkserver._safe_to_import("no_such_module_here")
    assert "threading_module" not in __import__("sys").modules  # tried in a child only
