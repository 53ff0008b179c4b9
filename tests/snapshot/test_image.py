"""The GPU memory image format: what a replica records beside its snapshot, and every way it is refused."""
import json

from ember.snapshot.image import GpuImage, ImageRegion, blob_name
from ember.snapshot.store import LocalStore

DEVICE = "NVIDIA H200, CUDA driver 13000"
IMAGE = GpuImage("qwen3.bfloat16.abc", DEVICE, (ImageRegion("weights", 0x302000000, 8 << 30, True),
                                                 ImageRegion("kv_cache", 0x502000000, 100 << 30, False)))


def test_an_image_round_trips_through_the_store_beside_its_snapshot(ember_home):
    store = LocalStore()
    store.put_blob(blob_name(IMAGE.snapshot), IMAGE.encode())
    regions, reason = GpuImage.usable(store.get_blob(blob_name(IMAGE.snapshot)), IMAGE.snapshot, DEVICE)
    assert reason is None and regions == IMAGE.regions
    assert GpuImage.decode(IMAGE.encode()) == IMAGE


def test_a_missing_corrupt_or_foreign_image_is_refused_with_the_reason():
    data = IMAGE.encode()
    edited = data.replace(b'"size": 8589934592', b'"size": 8589934593')
    assert edited != data
    cases = {
        None: "no GPU memory image recorded yet",
        edited: "corrupt GPU memory image: its checksum does not match its contents",
        data[:len(data) // 2]: "corrupt GPU memory image",
        b"\xff\xfe": "corrupt GPU memory image",
        json.dumps({"sha256": "0", "image": []}).encode(): "corrupt GPU memory image",
    }
    for blob, reason in cases.items():
        regions, why = GpuImage.usable(blob, IMAGE.snapshot, DEVICE)
        assert regions == () and why.startswith(reason), (blob, why)
    regions, why = GpuImage.usable(data, IMAGE.snapshot, "NVIDIA H100, CUDA driver 12080")
    assert regions == () and why == f"the image was recorded on {DEVICE!r}, this is 'NVIDIA H100, CUDA driver 12080'"
    regions, why = GpuImage.usable(data, "qwen3.bfloat16.def", DEVICE)
    assert regions == () and "belongs to snapshot 'qwen3.bfloat16.abc'" in why
