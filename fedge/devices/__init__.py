"""Devices: the profile a device reports (or a simulation declares) and, next, the simulated clock."""

from fedge.devices.profile import MAX_PROFILE_BYTES, DeviceProfile, measure_device

__all__ = ["MAX_PROFILE_BYTES", "DeviceProfile", "measure_device"]
