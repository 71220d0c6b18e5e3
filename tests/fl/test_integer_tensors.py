"""Integer tensors stay exact: through compressed downloads on both sides, and when a float is cast back."""

from __future__ import annotations

import logging

import numpy as np

from fedge.protocol.reference import advance_reference, exact_tensors
from fedge.server.downlink import DownlinkConfig, ModelBroadcast

DTYPES = {"w": "float32", "offset": "int64", "mask": "bool", "scale": "float32"}


def _model(offset: list[int], weight: float) -> dict[str, np.ndarray]:
    return {
        "w": np.full((64,), weight, np.float32),
        "offset": np.array(offset, np.float32),
        "mask": np.array([1, 0, 1], np.float32),
        "scale": np.array([1e5], np.float32),
    }


def test_integer_buffers_reach_clients_exactly_through_full_models_and_deltas(caplog):
    broadcast = ModelBroadcast(DownlinkConfig(codec="topk:0.5+int8", full_model="fp16"))
    exact = exact_tensors(DTYPES)
    assert exact == {"offset", "mask"}
    with caplog.at_level(logging.WARNING, logger="fedge.server.downlink"):
        first = broadcast.prepare(1, _model([100003, 7, 2049], 0.5), [11], DTYPES)[11]
    # the client's step, on the bytes it receives (fp16 holds whole numbers only up to 2048)
    client = advance_reference(None, first.payload, full=True, grid="fp16", max_elements=1 << 20, exact=exact)
    np.testing.assert_array_equal(client["offset"], [100003, 7, 2049])
    broadcast.confirm(11, 1, first)
    second = broadcast.prepare(2, _model([100011, 7, 4099], 0.25), [11], DTYPES)[11]
    assert second.is_delta
    client = advance_reference(
        client, second.payload, full=False, grid="fp16", max_elements=1 << 20, exact=exact
    )
    np.testing.assert_array_equal(client["offset"], [100011, 7, 4099])
    for name in DTYPES:  # the two copies of the reference stay identical
        np.testing.assert_array_equal(client[name], broadcast.reference[name])
    # the float beyond fp16's range is saturated on both sides, and the coordinator says so, once
    assert client["scale"][0] == 65504.0
    assert caplog.text.count("tensor scale holds values beyond fp16's range") == 1
    assert "tensor w " not in caplog.text and "offset" not in caplog.text


def test_floats_beyond_an_integer_dtypes_range_are_clipped_to_it_not_wrapped():
    """A cast of 3e38 to int64 is undefined (it came back as the smallest int64); the range's ends stay."""
    from fedge.protocol.arrays import record_to_numpy
    from fedge.protocol.records import arrays_to_record

    arrays = {"a": np.array([3e38, -3e38, 5.4], np.float32), "b": np.array([3e38, 7.6, 2**31], np.float32)}
    got = record_to_numpy(arrays_to_record(arrays, {"a": "int64", "b": "int32"}))
    assert got["a"][0] > 2**62 and got["a"][1] == np.iinfo(np.int64).min and got["a"][2] == 5
    assert got["b"].tolist() == [2**31 - 1, 8, 2**31 - 1]
