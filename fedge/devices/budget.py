"""Per-client budgets: how many bytes a client can upload before the deadline, the top-k density that fits
them, and whether a device has the memory to train the model at all.

Sizes are bytes, rates bytes/s, times seconds. The top-k cost model follows fedge's design notes
(DESIGN.md section 3): k nonzeros of n cost about ``H(p)/p`` bits each for their positions (p = k/n;
Golomb-Rice coding comes within 0.1 bit of it) plus the value bits: ~16.1 bits per nonzero for top-k + int8
at 1%.
"""

from __future__ import annotations

import math

from fedge.config import ConfigError
from fedge.devices.fleet import MB, ComputeProfile, LinkProfile

__all__ = [
    "OPTIMIZER_SLOTS",
    "TOPK_INT8_BITS",
    "can_train",
    "topk_bits",
    "topk_density",
    "training_memory_bytes",
    "upload_budget_bytes",
]

TOPK_INT8_BITS = 16.1
"""Bits per kept entry of top-k + int8 at 1% density (8.1 position + 8 value bits)."""

OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "adam": 2}
"""Values the optimizer keeps per parameter."""


def upload_budget_bytes(
    link: LinkProfile,
    time_left_s: float,
    *,
    overhead_bytes: int = 0,
    expected_disconnects: bool = True,
) -> int:
    """The largest upload (bytes) that reaches the coordinator within ``time_left_s`` on this link.

    Parameters
    ----------
    link : LinkProfile
        The client's link: uplink rate (bytes/s), latency, and disconnect rates.
    time_left_s : float
        Seconds between the end of the client's encode and the deadline: deadline minus download, decode,
        compute and encode time.
    overhead_bytes : int (default: 0)
        Bytes on the wire besides the payload (message framing), subtracted from the budget.
    expected_disconnects : bool (default: True)
        Charge the expected number of disconnects (each re-sending a window and reconnecting), as the clock
        does on average; False budgets the bare link.

    Returns
    -------
    int
        Payload bytes, >= 0 (0 when even an empty message would be late).
    """

    def seconds(nbytes: float) -> float:
        # The clock's transfer() with the expected (fractional) disconnect count: it is linear in the count.
        n = 0.0
        if expected_disconnects:
            n = (
                link.disconnects_per_s * nbytes / link.uplink_bytes_per_s
                + link.disconnects_per_mb * nbytes / MB
            )
        resent = n * min(link.resend_window_bytes, nbytes)
        return link.latency_s + (nbytes + resent) / link.uplink_bytes_per_s + n * link.reconnect_s

    # seconds() increases with nbytes, so bisect between 0 and the bare link's capacity.
    capacity = (time_left_s - link.latency_s) * link.uplink_bytes_per_s  # inf for an endless deadline
    lo, hi = 0, int(min(capacity, 1 << 62)) if capacity > 0 else 0
    if hi == 0 or seconds(overhead_bytes + 1) > time_left_s:
        return 0
    if seconds(hi) <= time_left_s:
        return max(0, hi - overhead_bytes)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if seconds(mid) <= time_left_s else (lo, mid)
    return max(0, lo - overhead_bytes)


def topk_bits(density: float, value_bits: float = 8.0) -> float:
    """Bits per kept entry of a top-k payload at ``density``: ``H(p)/p`` position bits plus ``value_bits``."""
    p = density
    if not 0 < p < 1:
        return value_bits
    entropy = -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    return entropy / p + value_bits


def topk_density(
    budget_bytes: float,
    num_params: int,
    *,
    bits_per_entry: float | None = TOPK_INT8_BITS,
    value_bits: float = 8.0,
    header_bytes: int = 0,
) -> float:
    """The top-k density whose payload fits ``budget_bytes``.

    Parameters
    ----------
    budget_bytes : float
        Payload bytes the client may send (e.g. from :func:`upload_budget_bytes`).
    num_params : int
        Entries in the model update.
    bits_per_entry : float or None (default: 16.1)
        Bits per kept entry. None uses the entropy model ``H(p)/p + value_bits``, which charges more bits per
        entry at lower densities (11.4 position bits at 0.1% against 8.1 at 1%).
    value_bits : float (default: 8.0)
        Bits per value for the entropy model (8 for int8, 1 for sign).
    header_bytes : int (default: 0)
        Fixed bytes of the payload (wire header, tensor names), subtracted first.

    Returns
    -------
    float
        Density in [0, 1]: kept entries / ``num_params``. 1.0 means the budget is no constraint.
    """
    if num_params < 1:
        raise ConfigError(f"num_params must be >= 1, got {num_params}")
    bits = 8.0 * (budget_bytes - header_bytes)
    if bits <= 0:
        return 0.0
    if bits_per_entry is not None:
        return min(1.0, math.floor(bits / bits_per_entry) / num_params)
    # n * p * topk_bits(p) = n * (H(p) + p * value_bits) grows with p up to 1/2: bisect on it.

    def cost(p: float) -> float:
        return num_params * p * topk_bits(p, value_bits)

    if cost(0.5) <= bits:  # past 1/2, dense values without positions (value_bits each) are the cheaper form
        return 1.0 if bits >= num_params * value_bits else 0.5
    lo, hi = 0.0, 0.5
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cost(mid) <= bits else (lo, mid)
    return math.floor(lo * num_params) / num_params


def training_memory_bytes(
    num_params: int,
    *,
    activation_values_per_sample: int,
    batch_size: int,
    optimizer: str = "sgd",
    extra_model_copies: int = 2,
    bytes_per_value: int = 4,
) -> int:
    """Bytes one training step needs.

    ``bytes_per_value * (num_params * (2 + slots + extra_model_copies) + batch_size *
    activation_values_per_sample)``: parameters and gradients (2), the optimizer's state (``slots`` values
    per parameter, :data:`OPTIMIZER_SLOTS`), the model copies fedge keeps, and the activations autograd keeps
    for the backward pass. The runtime itself (Python, torch: ~250 MB RSS on an agent) is not included:
    :attr:`ComputeProfile.memory_bytes` is what is left after it.

    Parameters
    ----------
    num_params : int
        Trainable parameters.
    activation_values_per_sample : int
        Values saved for backward per sample: about the sum of every layer's output size (double it for
        layers that also save their input, e.g. BatchNorm).
    batch_size : int
        Samples per step.
    optimizer : {"sgd", "momentum", "adam"} (default: "sgd")
        Decides the state per parameter (0, 1, 2 values).
    extra_model_copies : int (default: 2)
        fedge's compression mod keeps the received global model (to form the delta) and the error-feedback
        residual: 2 copies; 0 without compression.
    bytes_per_value : int (default: 4)
        fp32.
    """
    if optimizer not in OPTIMIZER_SLOTS:
        raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZER_SLOTS)}, got {optimizer!r}")
    if min(num_params, activation_values_per_sample, batch_size, extra_model_copies) < 0:
        raise ConfigError("counts must be >= 0")
    copies = 2 + OPTIMIZER_SLOTS[optimizer] + extra_model_copies
    return bytes_per_value * (num_params * copies + batch_size * activation_values_per_sample)


def can_train(device: ComputeProfile | int, required_bytes: int, *, usable_fraction: float = 0.9) -> bool:
    """Whether a device can train the full model: ``required_bytes <= usable_fraction * memory``.

    Parameters
    ----------
    device : ComputeProfile or int
        The device, or its memory available for training in bytes.
    required_bytes : int
        From :func:`training_memory_bytes`.
    usable_fraction : float (default: 0.9)
        Share of the memory a training run may fill; the rest absorbs allocator fragmentation and the
        temporaries of the codec, so a device is not planned to the last byte.
    """
    memory = device.memory_bytes if isinstance(device, ComputeProfile) else device
    return required_bytes <= usable_fraction * memory
