import pytest
import torch

from ember.snapshot.errors import SnapshotCorrupt
from ember.snapshot.format import ALIGN, PREAMBLE, decode, layout, parse_preamble


def test_layout_aligns_every_tensor_and_the_data_region_for_direct_io():
    specs = [
        ("a", torch.float32, (3,)),
        ("b", torch.bfloat16, (5000, 3)),
        ("c", torch.bool, ()),
        ("d", torch.int8, (0,)),
    ]
    header = layout(specs, chunk_size=2 * ALIGN)
    assert header.data_offset % ALIGN == 0 and header.data_size % ALIGN == 0
    assert all(t.offset % ALIGN == 0 for t in header.tensors)
    assert [t.nbytes for t in header.tensors] == [12, 30000, 1, 0]
    ends = [t.offset + t.nbytes for t in header.tensors]
    assert all(end <= nxt.offset or nxt.nbytes == 0 for end, nxt in zip(ends, header.tensors[1:]))
    assert len(header.chunks) == len(header.xxh3) == -(-header.data_size // header.chunk_size)
    assert len(header.preamble()) <= header.data_offset


def test_header_round_trips_and_is_bound_to_its_id():
    header = layout([("w", torch.float16, (7, 9))])
    raw = header.encode()
    assert decode(raw, header.id) == header
    with pytest.raises(SnapshotCorrupt, match="does not match its id"):
        decode(raw.replace(b'"w"', b'"x"'), header.id)


def test_bad_magic_and_garbage_header_are_corrupt():
    with pytest.raises(SnapshotCorrupt, match="bad magic"):
        parse_preamble(b"NOTEMBER" + bytes(8), "abc")
    with pytest.raises(SnapshotCorrupt, match="unreadable header"):
        decode(b"{not json")


def test_layout_refuses_chunks_that_break_alignment_and_unknown_dtypes():
    with pytest.raises(ValueError, match="multiple of 4096"):
        layout([("w", torch.float32, (4,))], chunk_size=5000)
    with pytest.raises(ValueError, match="do not store"):
        layout([("w", torch.uint16, (4,))])
    assert PREAMBLE == 16
