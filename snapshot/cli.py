"""`ember snapshot build|ls|rm|verify`: the ember CLI forwards `ember snapshot ...` to main()."""
import argparse
import json
import os
import sys
import time
from pathlib import Path

from ember.snapshot.errors import SnapshotCorrupt, SnapshotError
from ember.snapshot.loader import audit
from ember.snapshot.store import open_store, staging_path
from ember.snapshot.weights import bar
from ember.snapshot.writer import safetensors_files, write_safetensors


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ember snapshot", description="Build, list and remove weight snapshots.")
    sub = p.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="write a snapshot from a .safetensors file or a Hugging Face model dir "
                                         "(a model dir is stored in the LLM engine's layout: q/k/v and gate/up "
                                         "projections merged)")
    build.add_argument("src")
    build.add_argument("--name", help="name to file it under (default: the source's name)")
    commands = (build, sub.add_parser("ls", help="list snapshots"), sub.add_parser("rm", help="remove a snapshot"),
                sub.add_parser("verify", help="check every chunk's sha256; quarantine the snapshot if one fails"))
    for cmd in commands:
        cmd.add_argument("--store", default="local", help="'local' ($EMBER_HOME/snapshots) or s3://bucket/prefix")
    sub.choices["ls"].add_argument("--json", action="store_true", help="print JSON instead of a table")
    sub.choices["rm"].add_argument("key", metavar="ID|NAME")
    sub.choices["verify"].add_argument("key", metavar="ID|NAME")
    return p


def build(args) -> int:
    files = safetensors_files(args.src)
    name = args.name or Path(args.src).name.removesuffix(".safetensors")
    store = open_store(args.store)
    total = sum(f.stat().st_size for f in files)
    progress, shown = bar(total, f"build {name}")
    path, began = staging_path(), time.perf_counter()
    try:
        # The engine restores a model directory's snapshot straight into its merged parameters.
        header = write_safetensors(args.src, path, progress=progress, merge_projections=Path(args.src).is_dir())
        shown.close()
        ref = store.put(path, name)
    finally:
        shown.close()
        if path.exists():
            os.remove(path)
    seconds = time.perf_counter() - began
    print(f"built {name} {ref.id[:12]}: {len(header.tensors)} tensors, {ref.size / 1e9:.2f} GB "
          f"in {seconds:.1f} s -> {ref.store}")
    return 0


def ls(args) -> int:
    refs = open_store(args.store).ls()
    if args.json:
        print(json.dumps([r.to_json() for r in refs], indent=2))
        return 0
    print(f"{'ID':<12}  {'NAME':<24}  {'SIZE':>10}  {'TENSORS':>7}  CREATED")
    for r in refs:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created))
        tensors = "corrupt" if r.problem else r.tensors
        print(f"{r.id[:12]:<12}  {','.join(r.names) or '-':<24}  {r.size / 1e9:>8.2f}GB  {tensors:>7}  {created}")
    for r in refs:
        if r.problem:
            print(f"{r.id[:12]} is corrupt ({r.problem}): `ember snapshot verify {r.id[:12]}` quarantines it; "
                  "rebuild it with `ember snapshot build`", file=sys.stderr)
    return 0


def rm(args) -> int:
    ref = open_store(args.store).rm(args.key)
    print(f"removed {ref.id[:12]} ({', '.join(ref.names) or 'unnamed'})")
    return 0


def verify(args) -> int:
    store = open_store(args.store)
    try:
        source = store.open(args.key)
        audit(source)
    except SnapshotCorrupt as err:
        store.quarantine(err.snapshot_id, err.reason)
        raise
    source.close()
    print(f"ok {source.id[:12]}: {len(source.header.chunks)} chunks match their sha256")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return {"build": build, "ls": ls, "rm": rm, "verify": verify}[args.command](args)
    except (SnapshotError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
