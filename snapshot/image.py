"""The GPU memory image: which device address ranges a replica's engine holds and what each holds, recorded
beside the weight snapshot after the engine started, so that the next replica on the node reserves the same
ranges before anything else allocates and restores the weights into them.

    store.put_blob(blob_name(key), GpuImage(key, device, regions).encode())
    regions, reason = GpuImage.usable(store.get_blob(blob_name(key)), key, device)   # reason says why not

The blob is JSON with a sha256 over its body: a truncated or edited image, one from another device or driver,
or one recorded beside another snapshot is refused with the reason, and the replica allocates fresh ranges.
"""
import hashlib
import json
from dataclasses import asdict, dataclass

FORMAT = 1


@dataclass(frozen=True)
class ImageRegion:
    name: str        # "weights", "kv_cache"
    address: int     # device virtual address of the range
    size: int        # bytes reserved (a multiple of the mapping granularity)
    keep: bool       # its bytes matter (weights); otherwise it is scratch (the KV cache)


@dataclass(frozen=True)
class GpuImage:
    snapshot: str                       # the weight snapshot key it sits beside
    device: str                         # the device and driver it was recorded on
    regions: tuple[ImageRegion, ...]

    def encode(self) -> bytes:
        body = {"format": FORMAT, "snapshot": self.snapshot, "device": self.device,
                "regions": [asdict(r) for r in self.regions]}
        canonical = json.dumps(body, sort_keys=True)
        return json.dumps({"sha256": hashlib.sha256(canonical.encode()).hexdigest(), "image": body}).encode()

    @classmethod
    def decode(cls, data: bytes) -> "GpuImage":
        """Raises ValueError saying what is wrong with a corrupt image."""
        try:
            outer = json.loads(data)
            body = outer["image"]
            if hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest() != outer["sha256"]:
                raise ValueError("its checksum does not match its contents")
            if body["format"] != FORMAT:
                raise ValueError(f"format {body['format']} is not {FORMAT}")
            regions = tuple(ImageRegion(str(r["name"]), int(r["address"]), int(r["size"]), bool(r["keep"]))
                            for r in body["regions"])
            return cls(str(body["snapshot"]), str(body["device"]), regions)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise ValueError(f"corrupt GPU memory image: {err}") from None

    @classmethod
    def usable(cls, data: bytes | None, snapshot: str, device: str) -> tuple[tuple[ImageRegion, ...], str | None]:
        """The recorded regions to reserve, or none and why not."""
        if data is None:
            return (), "no GPU memory image recorded yet"
        try:
            image = cls.decode(data)
        except ValueError as err:
            return (), str(err)
        if image.device != device:
            return (), f"the image was recorded on {image.device!r}, this is {device!r}"
        if image.snapshot != snapshot:
            return (), f"the image belongs to snapshot {image.snapshot!r}, not {snapshot!r}"
        return image.regions, None


def blob_name(snapshot: str) -> str:
    return f"{snapshot}.gpu-image"
