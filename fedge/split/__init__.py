"""Split federated training: devices too small for the model train its front, the coordinator the rest.

A client whose memory cannot hold full-model training (:func:`plan_fleet`, from its device profile) trains
the layers before a cut; the coordinator trains the rest. Every split step sends the activations at the cut
up (with the labels, or not in the U-shaped variant) and the gradient at the cut down, both through fedge's
codecs (:class:`CutConfig`). Client-side stages are averaged with the full-model clients' models each round
(:class:`SplitFedRun`); the server-side state is one model per split client (SplitFed V1) or one shared
model (V2). See ``docs/split-training.md``.

Pure torch: :mod:`.model` (cutting a chain), :mod:`.cut` (the payloads), :mod:`.step` (the two sides of a
step), :mod:`.check` (split vs unsplit gradients), :mod:`.memory` (who trains split), :mod:`.timing` (the
simulated clock), :mod:`.driver` (a round of a mixed fleet, in process). The engine over a Flower Grid:
:mod:`.messages` (what travels), :mod:`.client_app` (the ClientApp, its state in the Context),
:mod:`.session` and :mod:`.coordinator` (the coordinator's side), :mod:`.server_state` (its checkpoint)
and :mod:`.app` (the ServerApp, and running on a Grid or over MQTT), with :mod:`.rounds` shared by both.
"""

from fedge.split.check import cut_gradient_max_abs_diff, split_gradients
from fedge.split.config import RoundRecord, SplitFedConfig, SplitHistory
from fedge.split.coordinator import SplitCoordinator
from fedge.split.cut import SPARSE_NONZERO, CutCodec, CutConfig, CutLink, sparse_gradient
from fedge.split.driver import SplitFedRun, evaluate
from fedge.split.engine_config import EngineRound, SplitAppConfig
from fedge.split.memory import ClientPlan, MemoryConfig, StageMemory, measure_stage_memory, plan_fleet
from fedge.split.model import as_chain, block_cuts, ends_in_relu, split_chain, stage_key_maps
from fedge.split.server_state import SplitCheckpoint, load_split_checkpoint, save_split_checkpoint
from fedge.split.step import BackStage, FrontStage
from fedge.split.timing import StageFlops, StepCost, simulate_split_round, stage_flops

__all__ = [
    "SPARSE_NONZERO",
    "BackStage",
    "ClientPlan",
    "CutCodec",
    "CutConfig",
    "CutLink",
    "EngineRound",
    "FrontStage",
    "MemoryConfig",
    "RoundRecord",
    "SplitAppConfig",
    "SplitCheckpoint",
    "SplitCoordinator",
    "SplitFedConfig",
    "SplitFedRun",
    "SplitHistory",
    "StageFlops",
    "StageMemory",
    "StepCost",
    "as_chain",
    "block_cuts",
    "cut_gradient_max_abs_diff",
    "ends_in_relu",
    "evaluate",
    "load_split_checkpoint",
    "measure_stage_memory",
    "plan_fleet",
    "save_split_checkpoint",
    "simulate_split_round",
    "sparse_gradient",
    "split_chain",
    "split_gradients",
    "stage_flops",
    "stage_key_maps",
]
