"""What crosses the cut: activations up, gradients down, each through a fedge codec.

A :class:`CutCodec` turns one tensor into a fedge payload (:mod:`fedge.compression`: ``fp32``, ``fp16``,
``int8``, ``topk:0.1+int8``, ``threshold:1e-30+int8`` …) and back, optionally with error feedback. The
residual is per direction and per link; a batch of another shape (the last, short batch of an epoch) starts
it afresh. Error feedback suits the cut gradient of a client that sees similar batches in turn; for
activations (a different batch each step) it is off by default.

:func:`sparse_gradient` is the one trick that costs nothing: when the front stage ends in a ReLU, the
client's backward multiplies the cut gradient by ``activation > 0``, so the coordinator may zero the
gradient wherever the activation it received is zero before encoding it (the sparse codecs then send only
the nonzeros). The labels travel as ``int64`` bytes (:func:`encode_labels`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fedge.compression import CodecError, ErrorFeedback, build_codec, decode
from fedge.compression.codec import Codec

__all__ = [
    "MAX_CUT_ELEMENTS",
    "SPARSE_NONZERO",
    "CutCodec",
    "CutConfig",
    "CutLink",
    "decode_labels",
    "decode_tensor",
    "encode_labels",
    "sparse_gradient",
]

SPARSE_NONZERO = "threshold:1e-30+int8"
"""Only the nonzero values, int8: ReLU activations and masked gradients are about half zeros."""


@dataclass(frozen=True)
class CutConfig:
    """How the tensors at the cut travel.

    Parameters
    ----------
    activation_codec : str (default: "fp32")
        Codec spec for the activations the client sends (and, U-shaped, the server's output it returns).
    gradient_codec : str (default: "fp32")
        Codec spec for the gradients at the cut.
    activation_feedback : bool (default: False)
        Error feedback on the activations (rarely useful: every batch is new).
    gradient_feedback : bool (default: False)
        Error feedback on the cut gradients.
    mask_gradient : bool (default: True)
        Zero the cut gradient where the received activation is zero, when the front ends in a ReLU
        (lossless: see :func:`sparse_gradient`).
    """

    activation_codec: str = "fp32"
    gradient_codec: str = "fp32"
    activation_feedback: bool = False
    gradient_feedback: bool = False
    mask_gradient: bool = True

    def __post_init__(self) -> None:
        build_codec(self.activation_codec)  # fail early, with the codec's own message
        build_codec(self.gradient_codec)


@dataclass
class CutCodec:
    """Encode and decode one tensor at the cut, counting the bytes.

    Parameters
    ----------
    spec : str
        A fedge codec spec.
    error_feedback : bool (default: False)
        Keep what compression left out and add it to the next tensor of the same shape.
    name : str (default: "cut")
        The tensor's name in the payload.
    """

    spec: str
    error_feedback: bool = False
    name: str = "cut"
    sent_bytes: int = 0
    dense_bytes: int = 0
    state: dict[str, np.ndarray] = field(default_factory=dict)
    _codec: Codec | None = field(default=None, repr=False)

    @property
    def codec(self) -> Codec:
        """The codec the spec builds (built once)."""
        if self._codec is None:
            self._codec = build_codec(self.spec)
        return self._codec

    def encode(self, tensor: torch.Tensor, *, seed: int = 0) -> bytes:
        """The payload carrying ``tensor`` (float32, any shape); adds to :attr:`sent_bytes`."""
        array = tensor.detach().to(torch.float32).contiguous().numpy()
        if self.error_feedback:
            residual = self.state.get("ef/residual/" + self.name)
            if residual is not None and residual.shape != array.shape:
                self.state.clear()  # a short last batch: start its residual afresh
            payload = ErrorFeedback(self.codec).encode({self.name: array}, self.state, seed=seed)
        else:
            payload = self.codec.encode({self.name: array}, seed=seed)
        self.sent_bytes += len(payload)
        self.dense_bytes += 4 * array.size
        return payload


@dataclass
class CutLink:
    """The encoders of one client's cut, both directions, and what they sent.

    ``activation_up`` and ``gradient_down`` serve every split step; the U-shaped variant also sends the
    server stage's output down (``activation_down``) and the gradient at it back up (``gradient_up``).
    Each client has its own link (so its own error-feedback residuals), also when the server-side model
    is shared (SplitFed V2).
    """

    config: CutConfig = field(default_factory=CutConfig)
    label_bytes: int = 0

    def __post_init__(self) -> None:
        c = self.config
        self.activation_up = CutCodec(c.activation_codec, c.activation_feedback, "activation")
        self.gradient_down = CutCodec(c.gradient_codec, c.gradient_feedback, "gradient")
        self.activation_down = CutCodec(c.activation_codec, c.activation_feedback, "activation")
        self.gradient_up = CutCodec(c.gradient_codec, c.gradient_feedback, "gradient")

    def codecs(self) -> tuple[CutCodec, ...]:
        """The four encoders."""
        return (self.activation_up, self.gradient_down, self.activation_down, self.gradient_up)

    @property
    def up_bytes(self) -> int:
        """Bytes the client sent: activations, labels and (U-shaped) gradients."""
        return self.activation_up.sent_bytes + self.gradient_up.sent_bytes + self.label_bytes

    @property
    def down_bytes(self) -> int:
        """Bytes the coordinator sent: gradients and (U-shaped) its stage's output."""
        return self.gradient_down.sent_bytes + self.activation_down.sent_bytes

    @property
    def tensor_bytes(self) -> int:
        """Payload bytes of the cut tensors (labels excluded)."""
        return sum(codec.sent_bytes for codec in self.codecs())

    @property
    def dense_bytes(self) -> int:
        """What the same cut tensors take as raw float32."""
        return sum(codec.dense_bytes for codec in self.codecs())


MAX_CUT_ELEMENTS = 1 << 25
"""The most values a cut payload may hold (128 MB as float32; a ResNet's widest activation at batch 32 is
6.4 M): the payload's header is checked against it before anything is allocated."""


def decode_tensor(payload: bytes, max_elements: int = MAX_CUT_ELEMENTS) -> torch.Tensor:
    """The one tensor a cut payload carries, as float32; :class:`~fedge.compression.CodecError` if the
    payload is damaged, holds more than ``max_elements`` values or other than one tensor."""
    tensors = decode(payload, max_elements=max_elements)
    if len(tensors) != 1:
        raise CodecError(f"a cut payload holds one tensor, this one {len(tensors)}")
    (array,) = tensors.values()
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def sparse_gradient(gradient: torch.Tensor, activation: torch.Tensor) -> torch.Tensor:
    """``gradient`` zeroed where ``activation`` is zero (valid when the activation is a ReLU's output)."""
    return gradient * (activation != 0).to(gradient.dtype)


def encode_labels(labels: torch.Tensor) -> bytes:
    """Labels as little-endian ``int64`` bytes."""
    return labels.detach().to(torch.int64).numpy().astype("<i8").tobytes()


def decode_labels(payload: bytes) -> torch.Tensor:
    """Labels from :func:`encode_labels`; ValueError if the bytes are not whole ``int64`` values."""
    if len(payload) % 8:
        raise ValueError(f"{len(payload)} label bytes are not whole int64 values")
    return torch.from_numpy(np.frombuffer(payload, dtype="<i8").astype(np.int64))
