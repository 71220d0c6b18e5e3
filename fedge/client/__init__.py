"""Client side: mods, training, the device agent, ONNX Runtime inference."""

from fedge.client.compression_mod import CompressionMod

__all__ = ["CompressionMod"]
