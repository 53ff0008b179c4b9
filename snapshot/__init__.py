"""Weight snapshots: a file format, two stores and a loader that runs at device speed.

Format (format.py): a JSON header (tensor names, dtypes, shapes, offsets, and per 8 MiB
chunk a sha256 and an xxh3-128) and tensor data aligned to 4 KiB for O_DIRECT. A
snapshot's id is the sha256 of its header, so ids address content. Loads check every
chunk's xxh3 (sha256 is too slow for 25 GB/s on the GPU host's CPUs); ``audit(source)`` /
``ember snapshot verify`` check the sha256s.

Stores (store.py, s3.py), one interface: ``put(path, name) -> SnapshotRef`` (takes the
written file), ``resolve(key) -> id``, ``open(key) -> source``, ``ls()``, ``rm(key)``,
``quarantine(id, reason)``. ``open_store("local" | "s3://bucket/prefix")`` picks one;
the local store lives in ``$EMBER_HOME/snapshots`` (objects/, refs/, quarantine/); the S3
store uploads multipart and loads with parallel ranged GETs, no temporary file.

Loading (loader.py): ``load(source, targets=None, device="cpu", threads=None,
progress=None) -> (tensors, LoadReport)`` reads chunks with several threads (page cache
when it holds a chunk, else O_DIRECT; ranged GETs from S3) into huge-page buffers pinned for
the GPU (hostbuffer.py), checks each chunk, and copies it to the GPU on CUDA streams (queued
through ctypes, cudart.py) while the next chunks are read. ``LoadReport`` has ``bytes``, ``seconds``, ``gbps``
and ``phases`` (allocate / stream wall seconds; pin / read / verify / copy thread seconds).

Replica wiring (weights.py), for a function declared with ``snapshot=True``, in one call::

    model, start = restore_or_boot(make_model, load_weights, open_store(), key)
    # start.source: "snapshot" | "full"; start.load: LoadReport; start.captured: SnapshotRef

``make_model()`` builds the model on its device without loading weights; ``load_weights(model)``
is the full boot. The same, step by step::

    store = open_store()                       # or open_store("s3://bucket/prefix")
    try:
        report = restore_into(model, store, key, device="cuda")
    except SnapshotError:                      # corrupt (already quarantined) or mismatched
        report = None
    if report is None:                         # no snapshot, or it failed: full boot
        model = full_boot()
        capture(model, store, key)             # -> SnapshotRef, for the next start

``restore_into`` loads into the module's own (preallocated) tensors, so after it raises
the module is partly overwritten and must not serve: boot from scratch. Loads of 1 GiB
or more show a tqdm bar on stderr unless a ``progress(done, total)`` callback is given.

CLI (cli.py): ``ember snapshot build SRC [--name N] [--store local|s3://b/p]``,
``ember snapshot ls [--json]``, ``ember snapshot rm ID|NAME``, ``ember snapshot verify ID|NAME``
(full sha256 check; quarantines on failure); ``main(argv) -> int``.
"""

from ember.snapshot.errors import SnapshotCorrupt, SnapshotError, SnapshotMismatch, SnapshotNotFound
from ember.snapshot.loader import LoadReport, load
from ember.snapshot.store import LocalStore, SnapshotRef, open_store
from ember.snapshot.weights import WeightsStart, capture, restore_into, restore_or_boot

__all__ = ["LoadReport", "LocalStore", "SnapshotCorrupt", "SnapshotError", "SnapshotMismatch", "SnapshotNotFound",
           "SnapshotRef", "WeightsStart", "capture", "load", "open_store", "restore_into", "restore_or_boot"]
