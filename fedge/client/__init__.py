"""Client side: the compression mod and the device agent."""

from fedge.client.compression_mod import CompressionMod

__all__ = ["CompressionMod"]
