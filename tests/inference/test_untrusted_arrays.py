"""Arrays from the network (requests to a device, answers to ``fedge infer``) are decoded with caps on what
they cost, not only on what they claim."""

from __future__ import annotations

import io
import struct
import time
import tracemalloc
import zipfile

import numpy as np
import pytest

from fedge.inference import InputError
from fedge.inference.io import decode_arrays


def _bomb(megabytes: int) -> bytes:
    """An ``.npz`` whose one member is ``megabytes`` of zeros, its directory claiming 80 bytes."""
    buffer = io.BytesIO()
    with (
        zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive,
        archive.open("input.npy", "w", force_zip64=True) as member,
    ):
        for _ in range(megabytes):
            member.write(bytes(1 << 20))
    data = bytearray(buffer.getvalue())
    struct.pack_into("<I", data, data.rfind(b"PK\x01\x02") + 24, 80)
    return bytes(data)


def test_a_member_that_inflates_past_its_declared_size_costs_nothing():
    """ZipFile.read inflated a member whole before holding it to its declared size: 1 MB of request
    cost a device 2 GB and 2.9 s (inference sweep)."""
    bomb = _bomb(64)
    assert len(bomb) < 1 << 20
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(InputError, match=r"input\.npy"):
            decode_arrays(bomb, max_bytes=1 << 20, max_rows=1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"decoding held {peak / 2**20:.0f} MiB"
    assert time.perf_counter() - started < 1.0


def test_an_honest_archive_is_read():
    buffer = io.BytesIO()
    np.savez_compressed(buffer, tokens=np.arange(12, dtype=np.int64).reshape(3, 4), mask=np.ones((3, 4)))
    arrays = decode_arrays(buffer.getvalue(), max_bytes=1 << 20, max_rows=10)
    assert arrays["tokens"].tolist()[2] == [8, 9, 10, 11] and arrays["mask"].shape == (3, 4)
