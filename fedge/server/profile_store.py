"""The device profiles a coordinator heard, kept in its state directory across restarts.

An agent sends its profile once per connection; a coordinator restarted (or resumed) under a fleet that stayed
connected had none, and budgeted and sampled its devices as if nothing were known of them (resource sweep).
The file is written whole, atomically, after each profile that arrives (rare: one per agent connection).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from fedge.atomic import write_bytes_atomic
from fedge.config import ConfigError
from fedge.devices.profile import DeviceProfile

__all__ = ["PROFILES_FILE", "load_profiles", "save_profiles"]

log = logging.getLogger(__name__)

PROFILES_FILE = "profiles.json"


def load_profiles(path: Path) -> dict[str, DeviceProfile]:
    """The profiles kept at ``path`` (none if there is no file); a damaged file or entry is logged and
    left out."""
    if not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        log.warning("%s is damaged (%s); device profiles start empty", path, err)
        return {}
    profiles = {}
    for name, encoded in entries.items():
        try:
            profiles[str(name)] = DeviceProfile.from_bytes(bytes.fromhex(str(encoded)))
        except (ValueError, ConfigError) as err:
            log.warning("%s: the profile of %s is damaged (%s); left out", path, name, err)
    return profiles


def save_profiles(path: Path, profiles: Mapping[str, DeviceProfile]) -> None:
    """Write ``profiles`` to ``path`` atomically."""
    entries = {name: profile.to_bytes().hex() for name, profile in dict(profiles).items()}
    write_bytes_atomic(path, json.dumps(entries, sort_keys=True).encode())
