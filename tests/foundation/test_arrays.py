"""fedge.protocol.arrays reads and writes exactly what Flower's Array does, and falls back on anything odd."""

import io

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.exception import InconsistentMessageReplies
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedge.protocol.arrays import array_to_numpy, numpy_to_array
from fedge.server.fedavg import weighted_average

RNG = np.random.default_rng(0)
CASES = [
    RNG.standard_normal((16, 1, 3, 3)).astype(np.float32),
    RNG.standard_normal(10).astype(np.float32),
    np.array(7, dtype=np.int64),  # 0-d, like BatchNorm's num_batches_tracked
    np.zeros((0, 3)),
    RNG.standard_normal((3, 4)).astype(np.float16),
    np.array([True, False, True]),
    RNG.standard_normal((2, 3)).astype(">f4"),  # big-endian
    np.asfortranarray(RNG.standard_normal((3, 4))),
    RNG.standard_normal((4, 6))[:, ::2],  # neither C nor Fortran contiguous
    RNG.integers(0, 255, (5, 5), dtype=np.uint8),
]


@pytest.mark.parametrize("values", CASES, ids=lambda v: f"{v.dtype.str}{v.shape}")
def test_bytes_and_values_match_flower(values):
    ours, flowers = numpy_to_array(values), Array(values)
    assert ours.data == flowers.data
    assert (ours.dtype, tuple(ours.shape), ours.stype) == (flowers.dtype, tuple(flowers.shape), flowers.stype)
    read = array_to_numpy(flowers)
    expected = flowers.numpy()
    assert read.dtype == expected.dtype and read.shape == expected.shape
    np.testing.assert_array_equal(read, expected)


def test_bad_bytes_fail_as_flower_fails():
    good = Array(RNG.standard_normal((4, 4)).astype(np.float32)).data
    broken = [
        good[:-4],  # truncated values
        good + b"\x00" * 4,  # padding after the values
        good[:20],  # truncated header
        good.replace(b"False", b"True "),  # Fortran order
        good.replace(b"<f4", b"|O8"),  # object dtype: would need pickle
        b"\x93NUMPY\x09\x00" + good[8:],  # unknown format version
    ]
    for data in broken:
        array = Array(dtype="float32", shape=(4, 4), stype="numpy.ndarray", data=data)
        try:
            expected = array.numpy()
        except Exception as err:
            with pytest.raises(type(err)):
                array_to_numpy(array)
        else:
            np.testing.assert_array_equal(array_to_numpy(array), expected)
    for _ in range(300):  # random garbage after the magic
        data = b"\x93NUMPY" + RNG.integers(0, 256, int(RNG.integers(0, 120)), dtype=np.uint8).tobytes()
        array = Array(dtype="float32", shape=(4,), stype="numpy.ndarray", data=data)
        try:
            expected = array.numpy()
        except Exception as err:
            with pytest.raises(type(err)):
                array_to_numpy(array)
        else:
            np.testing.assert_array_equal(array_to_numpy(array), expected)


def test_a_header_claiming_more_values_than_sent_is_refused_before_allocation():
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**12,)})
    array = Array(dtype="float32", shape=(4,), stype="numpy.ndarray", data=header.getvalue() + bytes(16))
    with pytest.raises(ValueError, match="holds 16 bytes, its header's shape"):  # np.load: 4 TB, then fails
        array_to_numpy(array)


def test_weighted_average_is_bit_identical_to_flowers():
    contents = []
    for i in range(7):
        arrays = {
            "w": Array(RNG.standard_normal((32, 16, 3, 3)).astype(np.float32)),
            "b": Array(RNG.standard_normal(16).astype(np.float32)),
            "count": Array(np.array(i * 3, dtype=np.int64)),
        }
        metrics = MetricRecord({"num-examples": float(RNG.integers(1, 50))})
        contents.append(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}))
    ours, flowers = (
        weighted_average(contents, "num-examples"),
        aggregate_arrayrecords(contents, "num-examples"),
    )
    assert list(ours) == list(flowers)
    for name in ("w", "b"):
        assert ours[name].data == flowers[name].data, name
    # the counter stays an integer, rounded (Flower's float64 average is truncated by a client's load)
    assert ours["count"].numpy().dtype == np.int64
    assert ours["count"].numpy() == np.rint(flowers["count"].numpy())


def test_integer_buffers_keep_their_dtype_and_their_value():
    """Three clients with the same buffer [7, 100]: the average must be [7, 100], not 6.999... truncated."""
    buffer = np.array([7, 100], np.int64)
    contents = [
        RecordDict(
            {
                "arrays": ArrayRecord({"ids": Array(buffer), "mask": Array(np.array([True, False]))}),
                "metrics": MetricRecord({"num-examples": 1.0}),
            }
        )
        for _ in range(3)
    ]
    averaged = weighted_average(contents, "num-examples")
    assert averaged["ids"].numpy().tolist() == [7, 100] and averaged["ids"].numpy().dtype == np.int64
    assert averaged["mask"].numpy().tolist() == [True, False]


def test_dense_fedavg_screens_replies_like_flower():
    from fedge.flower.compat import set_task_identity
    from fedge.server.fedavg import DenseFedAvg

    set_task_identity(run_id=1)
    instruction = Message(RecordDict(), dst_node_id=9, message_type="train")
    arrays = ArrayRecord({"w": Array(np.ones(3, dtype=np.float32))})
    metrics = MetricRecord({"num-examples": 2.0, "train_loss": 0.5})
    good = Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=instruction)
    bad = Message(RecordDict({"metrics": MetricRecord({"num-examples": 2.0})}), reply_to=instruction)
    strategy = DenseFedAvg()
    aggregated, metrics = strategy.aggregate_train(1, [good])
    np.testing.assert_array_equal(aggregated["w"].numpy(), np.ones(3, dtype=np.float32))
    assert metrics["train_loss"] == 0.5
    with pytest.raises(InconsistentMessageReplies):  # a train reply without arrays: Flower's own check
        strategy.aggregate_train(1, [good, bad])
