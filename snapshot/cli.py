"""`ember snapshot build|ls|rm|verify`: the ember CLI forwards `ember snapshot ...` to main()."""
import argparse
import json
import os
import sys
import time
from pathlib import Path

from safetensors import SafetensorError

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
        ref = store.put(path, name, digested=True)
    finally:
        shown.close()
        if path.exists():
            os.remove(path)
    seconds = time.perf_counter() - began
    print(f"built {name} {ref.id[:12]}: {len(header.tensors)} tensors, {human_size(ref.size)} "
          f"in {seconds:.1f} s -> {ref.store}")
    return 0


def human_size(size: int) -> str:
    """Bytes in the largest unit that keeps a number >= 1: 512 B, 3.4 KB, 87.1 MB, 16.02 GB (powers of 1000, as ls
    -h --si and the build line)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}" if unit == "GB" else f"{size / scale:.1f} {unit}"
    return f"{size} B"


def ls(args) -> int:
    refs = open_store(args.store).ls()
    if args.json:
        print(json.dumps([r.to_json() for r in refs], indent=2))
        return 0
    rows = [(r.id[:12], ",".join(r.names) or "-", human_size(r.size), "corrupt" if r.problem else str(r.tensors),
             time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created))) for r in refs]
    name_width = max([len("NAME")] + [len(row[1]) for row in rows])  # a long name widens the column, not the row
    for row in [("ID", "NAME", "SIZE", "TENSORS", "CREATED")] + rows:
        print(f"{row[0]:<12}  {row[1]:<{name_width}}  {row[2]:>9}  {row[3]:>7}  {row[4]}")
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


def _explain(err: Exception, args) -> str | None:
    """One line naming the fix for what a user's input or environment causes; None for a bug (its traceback shows)."""
    if isinstance(err, (SnapshotError, ValueError, FileNotFoundError)):
        return str(err)
    if isinstance(err, SafetensorError):
        return (f"{getattr(args, 'src', 'the source')} is not a readable safetensors file ({err}); re-download it "
                "(a partial download or a Git LFS pointer looks like this), or point at the model's directory")
    if "botocore" in sys.modules:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError

        if isinstance(err, NoCredentialsError):
            return (f"no AWS credentials for --store {args.store}: set AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY (AWS_ENDPOINT_URL for an emulator); or use --store local")
        if isinstance(err, NoRegionError):
            return f"no AWS region for --store {args.store}: set AWS_DEFAULT_REGION (e.g. us-east-1)"
        if isinstance(err, (BotoCoreError, ClientError)):
            return (f"--store {args.store}: {err}; check the bucket exists and the AWS credentials and region may use "
                    "it")
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return {"build": build, "ls": ls, "rm": rm, "verify": verify}[args.command](args)
    except Exception as err:
        message = _explain(err, args)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
