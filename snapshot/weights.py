"""What a replica calls for `snapshot=True`: restore weights from a snapshot, or capture one after a full boot.

    model, start = restore_or_boot(make_model, load_weights, store, key)

or, step by step:

    report = restore_into(model, store, key, device)   # None: no snapshot yet
    ...full boot when it returned None or raised SnapshotError...
    capture(model, store, key)                          # after the first full boot
"""
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ember.snapshot.errors import SnapshotCorrupt, SnapshotError, SnapshotNotFound
from ember.snapshot.format import CHUNK_SIZE
from ember.snapshot.loader import LoadReport, Progress, load
from ember.snapshot.store import SnapshotRef, SnapshotStore, staging_path
from ember.snapshot.writer import write_state_dict

log = logging.getLogger("ember.snapshot")
BAR_FROM = 1 << 30  # loads of a GiB or more show a progress bar unless a callback is given


def bar(total: int, desc: str) -> tuple[Progress, tqdm]:
    shown = tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, leave=False)

    def update(done: int, total_now: int) -> None:
        shown.total = total_now  # a build learns the aligned size only once it starts writing
        shown.update(done - shown.n)

    return update, shown


def state_of(module_or_state: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(module_or_state, torch.nn.Module):
        return module_or_state.state_dict()
    return dict(module_or_state)


def capture(module_or_state: torch.nn.Module | Mapping[str, torch.Tensor], store: SnapshotStore, key: str,
            chunk_size: int = CHUNK_SIZE, progress: Progress | None = None) -> SnapshotRef:
    """Writes the module's state dict as a snapshot into `store` under the name `key`."""
    path = staging_path()
    try:
        write_state_dict(state_of(module_or_state), path, chunk_size, progress)
        return store.put(path, key, digested=True)
    finally:
        if os.path.exists(path):
            os.remove(path)


def restore_into(module: torch.nn.Module | Mapping[str, torch.Tensor], store: SnapshotStore, key: str,
                 device: str | torch.device | None = None, threads: int | None = None,
                 progress: Progress | None = None) -> LoadReport | None:
    """Loads snapshot `key` into the module's own tensors, in place.

    Returns None when the store holds no such snapshot. Raises SnapshotCorrupt, after
    quarantining the snapshot, when a checksum or size fails, and SnapshotMismatch when the
    snapshot holds other tensors than the module (nothing is copied then). After any
    SnapshotError the module's weights are partly overwritten: boot it from scratch.
    `device` is only checked: the module must already sit there (its tensors are the targets).
    """
    targets = state_of(module)
    if device is not None and targets:
        where = next(iter(targets.values())).device
        if torch.device(device).type != where.type:
            raise ValueError(f"module is on {where}, asked to restore onto {device}; move the module first")
    try:
        source = store.open(key)
    except SnapshotNotFound:
        return None
    except SnapshotCorrupt as err:
        store.quarantine(err.snapshot_id, err.reason)
        log.warning("snapshot %s quarantined: %s", key, err.reason)
        raise
    shown = None
    if progress is None and source.header.data_size >= BAR_FROM:
        progress, shown = bar(source.header.data_size, f"restore {key}")
    try:
        _, report = load(source, targets, threads=threads, progress=progress)
    except SnapshotCorrupt as err:
        store.quarantine(err.snapshot_id, err.reason)
        log.warning("snapshot %s quarantined: %s", key, err.reason)
        raise
    finally:
        source.close()
        if shown is not None:
            shown.close()
    log.info("restored %s: %s", key, report)
    return report


def _store_errors() -> tuple[type[BaseException], ...]:
    """What a store raises when it cannot be reached: OSError, and boto's errors once an S3 store loaded boto."""
    if "botocore" not in sys.modules:
        return (OSError,)
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError
    return (OSError, Boto3Error, BotoCoreError, ClientError)


@dataclass
class WeightsStart:
    """How a replica got its weights: `snapshot` (with the load's report) or `full` (and what it captured)."""
    source: str
    seconds: float
    load: LoadReport | None = None
    captured: SnapshotRef | None = None
    fallback_reason: str | None = None


def restore_or_boot(
    make_model: Callable[[], torch.nn.Module],
    load_weights: Callable[[torch.nn.Module], None],
    store: SnapshotStore,
    key: str,
    progress: Progress | None = None,
) -> tuple[torch.nn.Module, WeightsStart]:
    """Weights from snapshot `key` when it is there and sound, else a full boot that then writes the snapshot.

    `make_model()` builds the model on its device with weights not yet loaded; `load_weights(model)`
    is the full boot. A failed restore leaves a half-written model, so it is dropped and built again.
    """
    began = time.perf_counter()
    model, reason = make_model(), None
    not_restorable: tuple[type[BaseException], ...] = (SnapshotError, *_store_errors())
    try:
        report = restore_into(model, store, key, progress=progress)
    except not_restorable as err:  # corrupt, or the store is unreachable: boot from the files
        report, reason = None, f"{type(err).__name__}: {err}"
        log.warning("snapshot %s not restored, booting from the model files: %s", key, reason)
        model = make_model()
    if report is not None:
        return model, WeightsStart("snapshot", time.perf_counter() - began, load=report)
    load_weights(model)
    try:
        captured = capture(model, store, key, progress=progress)
    except not_restorable as err:  # a full disk or an unreachable store must not fail the start
        log.warning("could not write snapshot %s: %s", key, err)
        captured = None
    return model, WeightsStart("full", time.perf_counter() - began, captured=captured, fallback_reason=reason)
