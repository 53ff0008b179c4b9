"""What can go wrong with a snapshot; every error says what to do next."""


class SnapshotError(Exception):
    """Base: the caller should fall back to a full boot."""


class SnapshotNotFound(SnapshotError):
    def __init__(self, key: str, where: str):
        super().__init__(f"no snapshot {key!r} in {where}; build one with `ember snapshot build SRC --name {key}`")


class SnapshotCorrupt(SnapshotError):
    """Checksums or sizes disagree with the header; the snapshot has been (or must be) quarantined."""

    def __init__(self, snapshot_id: str, reason: str):
        self.snapshot_id = snapshot_id
        self.reason = reason
        super().__init__(
            f"snapshot {snapshot_id[:12]} is corrupt ({reason}); it was quarantined, "
            "rebuild it with `ember snapshot build`"
        )


class SnapshotMismatch(SnapshotError):
    """The snapshot is intact but holds other tensors than the model expects (e.g. the code changed)."""
