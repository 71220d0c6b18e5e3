"""An artifact header from the network is parsed with caps, and anything malformed is an ArtifactError."""

from __future__ import annotations

import pytest

from fedge.transport.artifacts import MAX_HEADER_BYTES, ArtifactError, ArtifactHeader

LIMITS = {"max_size": 1 << 20, "max_chunk_size": 1 << 16}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"{}", "lacks 'name'"),
        # nested past the interpreter's stack, under the size cap: a RecursionError's traceback in the agent's
        # log, and the header was not counted as refused (inference sweep)
        (b"[" * 30_000 + b"]" * 30_000, "not JSON"),
        (b'{"meta": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", "not JSON"),
    ],
    ids=["bytes", "list", "empty", "deep", "deep-meta"],
)
def test_a_malformed_header_is_an_artifact_error(payload, message):
    assert len(payload) <= MAX_HEADER_BYTES
    with pytest.raises(ArtifactError, match=message):
        ArtifactHeader.decode(payload, **LIMITS)


def test_a_good_header_round_trips():
    header = ArtifactHeader.for_data("model-fp32", "v1", b"x" * 1000, 256, {"a": 1})
    assert ArtifactHeader.decode(header.encode(), **LIMITS) == header
