"""Per-client upload budgets: each client's codec chosen from its link so its upload fits the deadline.

A fleet's links differ by four orders of magnitude (a Jetson on Ethernet moves 110 MB/s up, an NB-IoT
gateway 2.5 kB/s), so one codec for everyone is either wasteful on the fast links or late on the slow
ones. :class:`UploadBudget` gives every client the top-k density (and value bit width) its own uplink can
carry within the round's deadline; the strategy then aggregates the mixed codecs in one sum, since every
payload names its codec (:func:`fedge.compression.decode_add`).

Pure: no Flower. The strategy learns the links from a Grid that knows them (``node_links()``, as the
simulated clock's Grid does); see :class:`fedge.server.streaming.StreamingFedAvg`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fedge.compression import CodecConfigError, build_codec
from fedge.devices.budget import topk_density, upload_budget_bytes
from fedge.devices.fleet import LinkProfile

__all__ = ["EVERY_TENSOR", "VALUE_STAGES", "UploadBudget"]

EVERY_TENSOR = ";min=0,patterns=*running_mean*|*running_var*|*num_batches*"
"""Tensor policy of budget codecs: every tensor compressed, except statistics (sent dense)."""

VALUE_STAGES: Mapping[int, tuple[str, float]] = {8: ("int8", 8 + 32 / 256), 4: ("int4", 4 + 32 / 64)}
"""Bit width -> (value stage of the spec, bits per kept value including the blocks' float32 scales)."""


MAX_DEADLINE_S = 1e7  # about 116 days: an upload's budget beyond it is no budget, and inf overflowed


@dataclass(frozen=True)
class UploadBudget:
    """Choose each client's uplink codec so that its upload fits the round's deadline.

    For a client whose uplink is known:

    1. Budget bytes. ``B = upload_budget_bytes(link, fraction * deadline_s, overhead_bytes)``: the payload
       the uplink moves in ``fraction * deadline_s`` seconds once its one-way latency (and the expected
       disconnects' re-sends and reconnects) are paid, less ``overhead_bytes`` of message framing. The
       rest of the deadline, ``(1 - fraction) * deadline_s``, is left to the download, decode, training
       and encode that precede the upload, and absorbs the cost model's error.
    2. Density. ``p = topk_density(B, model_elements, bits_per_entry=None, value_bits=v)``: the largest
       fraction of the ``n = model_elements`` entries whose positions (``H(p)/p`` bits per kept entry,
       what fedge's Golomb-Rice position coding comes within 0.1 bit of) and values (``v`` bits each,
       the blocks' float32 scales included: 8.125 for int8, 4.5 for int4) fit ``8 B`` bits.
    3. Bit width. ``bit_widths`` are tried widest first; a client whose density at that width is below
       ``narrow_below`` takes the next narrower one (more entries at a coarser value), down to the last.
    4. Clip. ``p`` is clipped to ``[min_density, max_density]``: a fast link never sends more than
       ``max_density`` (denser updates buy little accuracy), and a link too slow even for
       ``min_density`` still gets it -- the deadline then drops the reply, which error feedback folds back.

    The spec is ``f"topk:{p:.3g},min_count={min_count}+int8" + policy``. Top-k's ``min_count`` floor
    raises the density of a very small model to ``min_count / n``, which the budget does not charge.
    A client whose link is unknown gets ``default_codec`` (None: the strategy's own codec).

    Parameters
    ----------
    deadline_s : float
        Seconds from the round's start within which a reply must arrive (the schedule's deadline).
    fraction : float (default: 0.5)
        Share of ``deadline_s`` the upload may take, in (0, 1].
    min_density, max_density : float (default: 0.001, 0.1)
        Bounds of the chosen density, 0 < min_density <= max_density <= 1.
    bit_widths : tuple of int (default: (8,))
        Value bit widths to choose from, widest first, each a key of :data:`VALUE_STAGES`.
    narrow_below : float (default: 0.01)
        A density below which the next narrower bit width is taken.
    min_count : int (default: 256)
        Top-k's floor of kept entries (``min_count`` of the spec).
    policy : str (default: :data:`EVERY_TENSOR`)
        Tensor policy appended to each spec.
    overhead_bytes : int (default: 512)
        Bytes of a reply besides its payload (envelope, metrics), subtracted from the budget.
    default_codec : str or None (default: None)
        Codec of clients whose link is unknown; None leaves them to the strategy's codec.
    """

    deadline_s: float
    fraction: float = 0.5
    min_density: float = 0.001
    max_density: float = 0.1
    bit_widths: tuple[int, ...] = (8,)
    narrow_below: float = 0.01
    min_count: int = 256
    policy: str = EVERY_TENSOR
    overhead_bytes: int = 512
    default_codec: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.deadline_s <= MAX_DEADLINE_S:  # infinity, or a figure the byte count overflows on
            raise CodecConfigError(
                f"budget deadline_s must be in (0, {MAX_DEADLINE_S:g}] seconds, got {self.deadline_s}"
            )
        if not 0 < self.fraction <= 1:
            raise CodecConfigError(f"budget fraction must be in (0, 1], got {self.fraction}")
        if not 0 < self.min_density <= self.max_density <= 1:
            raise CodecConfigError("budget densities need 0 < min_density <= max_density <= 1")
        if not self.bit_widths or any(bits not in VALUE_STAGES for bits in self.bit_widths):
            raise CodecConfigError(f"budget bit_widths must be among {sorted(VALUE_STAGES)}")
        object.__setattr__(self, "bit_widths", tuple(sorted(set(self.bit_widths), reverse=True)))
        if self.min_count < 0 or self.overhead_bytes < 0:
            raise CodecConfigError("budget min_count and overhead_bytes must be >= 0")
        for bits in self.bit_widths:  # every spec this budget can write parses
            build_codec(self.spec(self.min_density, bits))
            build_codec(self.spec(self.max_density, bits))
        if self.default_codec is not None:
            build_codec(self.default_codec)

    def spec(self, density: float, bits: int = 8) -> str:
        """The codec spec of top-k at ``density`` with ``bits``-bit values."""
        return f"topk:{density:.3g},min_count={self.min_count}+{VALUE_STAGES[bits][0]}{self.policy}"

    def budget_bytes(self, link: LinkProfile) -> int:
        """Payload bytes ``link`` uploads within ``fraction * deadline_s`` (step 1)."""
        return upload_budget_bytes(link, self.fraction * self.deadline_s, overhead_bytes=self.overhead_bytes)

    def choose(self, link: LinkProfile, model_elements: int) -> tuple[float, int]:
        """The density and bit width of a client on ``link`` (steps 2-4)."""
        budget = self.budget_bytes(link)
        density, bits = 0.0, self.bit_widths[0]
        for bits in self.bit_widths:
            value_bits = VALUE_STAGES[bits][1]
            density = topk_density(budget, model_elements, bits_per_entry=None, value_bits=value_bits)
            if density >= self.narrow_below:
                break
        return min(self.max_density, max(self.min_density, density)), bits

    def codec(self, link: LinkProfile, model_elements: int) -> str:
        """The codec spec of a client on ``link`` uploading updates of ``model_elements`` entries."""
        return self.spec(*self.choose(link, model_elements))

    def codecs(self, node_links: Mapping[int, LinkProfile | None], model_elements: int) -> dict[int, str]:
        """Each node's codec spec: from its link, or ``default_codec`` when its link is None (such nodes
        are left out when ``default_codec`` is None, for the strategy's codec)."""
        out: dict[int, str] = {}
        cache: dict[LinkProfile, str] = {}  # fleets share a few link classes
        for node, link in node_links.items():
            if link is None:
                if self.default_codec is not None:
                    out[node] = self.default_codec
                continue
            if link not in cache:
                cache[link] = self.codec(link, model_elements)
            out[node] = cache[link]
        return out
