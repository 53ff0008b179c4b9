"""Log files kept to a size and a number (runtime/log_budget.py), as the gateway and the node agents keep theirs."""
import os
from pathlib import Path

from ember.gateway.logfeed import LogFile
from ember.runtime.log_budget import prune_ended, rotate_large


def test_a_log_over_its_size_is_rotated_and_its_followers_start_it_afresh(tmp_path):
    """Replica logs grew without end (a replica printing what its callers send could fill the disk that the
    gateway's database shares); past LOG_MAX_BYTES a log is copied to NAME.log.1 and cut, and its writer's next
    line, appended, starts it afresh."""
    big, small = tmp_path / "app.f-1.log", tmp_path / "gateway.log"
    small.write_text("quiet\n")
    writer = os.open(big, os.O_WRONLY | os.O_APPEND | os.O_CREAT)   # as the supervisor opens a replica's log
    os.write(writer, b"old line\n" * 1000)
    follower = LogFile(big, {"app": "app"}, 0)
    assert len(follower.read()) == 1000
    assert rotate_large(tmp_path, limit=4096) == [big]
    assert big.stat().st_size == 0 and (tmp_path / "app.f-1.log.1").read_bytes() == b"old line\n" * 1000
    assert small.read_text() == "quiet\n" and not (tmp_path / "gateway.log.1").exists()
    os.write(writer, b"new line\n")
    os.close(writer)
    assert big.read_bytes() == b"new line\n"   # appended at the new end: no hole where the old bytes were
    assert [r["msg"] for r in follower.read()] == ["new line"]
    assert rotate_large(tmp_path, limit=4096) == []


def test_ended_replicas_logs_are_kept_a_week_and_the_newest_500_and_live_ones_always(tmp_path):
    """Every replica start writes a new log, so a function that scaled to zero and back left one more file each
    time, for ever (and `ember logs -f` opened every one of them at each poll)."""
    now = 1_000_000_000.0
    day = 86400.0

    def log(name: str, age_days: float) -> Path:
        path = tmp_path / name
        path.write_text("line\n")
        os.utime(path, (now - age_days * day,) * 2)
        return path

    old, recent, live, gateway = (log("a.f-old.log", 8), log("a.f-new.log", 6), log("a.f-live.log", 30),
                                  log("gateway.log", 30))
    (tmp_path / "a.f-old.log.1").write_text("its rotated part\n")
    follower = LogFile(old, {"app": "a"}, 0)
    assert prune_ended(tmp_path, {live, gateway}, now) == [old]
    assert not old.exists() and not (tmp_path / "a.f-old.log.1").exists()
    assert recent.exists() and live.exists() and gateway.exists()   # young, and two still written
    assert follower.read() == [] and follower.gone   # a follower lets it go
    many = [log(f"b.f-{i}.log", 1 + i / 1000) for i in range(6)]   # by count: the newest kept
    assert prune_ended(tmp_path, {live, gateway}, now, keep_files=4) == [many[4], many[5], recent]
    assert {p.name for p in tmp_path.iterdir()} == {p.name for p in [live, gateway, *many[:4]]}
    fresh = log("c.f-starting.log", 0.01)   # written in the last hour (a replica starting): kept whatever the count
    assert prune_ended(tmp_path, {gateway}, now, keep_files=0) != [] and fresh.exists() and not live.exists()
