"""Coordinator side: strategies, aggregation, checkpoints, the coordinator service."""

from fedge.server.async_runner import FedBuffStrategy
from fedge.server.budget import UploadBudget
from fedge.server.channel import CompressedChannel, CompressionConfig, RoundReport
from fedge.server.decoding import DecodingStrategy
from fedge.server.dense_screening import ScreenedStrategy
from fedge.server.downlink import DownlinkConfig, ModelBroadcast
from fedge.server.fedavg import DenseFedAvg
from fedge.server.fedbuff import FedBuff
from fedge.server.optimizers import ServerOptimizer
from fedge.server.robust import RobustConfig, RobustStreamingFedAvg
from fedge.server.schedule import Schedule
from fedge.server.schedule_grid import ScheduledGrid
from fedge.server.screening import ReplyScreen
from fedge.server.streaming import StreamingFedAvg

__all__ = [
    "CompressedChannel",
    "CompressionConfig",
    "DecodingStrategy",
    "DenseFedAvg",
    "DownlinkConfig",
    "FedBuff",
    "FedBuffStrategy",
    "ModelBroadcast",
    "ReplyScreen",
    "RobustConfig",
    "RobustStreamingFedAvg",
    "RoundReport",
    "Schedule",
    "ScheduledGrid",
    "ScreenedStrategy",
    "ServerOptimizer",
    "StreamingFedAvg",
    "UploadBudget",
]
