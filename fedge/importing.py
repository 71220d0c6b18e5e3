"""Resolving ``package.module:name`` or ``path/to/file.py:name``, as the CLI and config files name tasks
and ClientApps. What a network message names must be checked against the local configuration first.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["import_attribute"]


def import_attribute(path: str, what: str, error: type[ValueError] = ValueError) -> Any:
    """The object ``name`` of a module (by import name, or by file if the left part ends in ``.py``), or
    None if the module has no such name.

    Raises ``error`` naming ``what`` if ``path`` is malformed or the module does not import (whatever the
    module itself raises: a user's module must not crash the coordinator or agent).
    """
    module_name, sep, attribute = path.rpartition(":")
    if not sep or not module_name or not attribute:
        raise error(f"{what} {path!r} is not of the form 'package.module:name' or 'path/to/file.py:name'")
    try:
        module = (
            _from_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
        )
    except Exception as err:
        raise error(f"{what} module {module_name!r} does not import: {err}") from err
    return getattr(module, attribute, None)


def _from_file(file: str) -> ModuleType:
    """Import a Python file as a module, once per process (named after its resolved path)."""
    location = Path(file).expanduser().resolve()
    if not location.is_file():
        raise FileNotFoundError(f"no file {location}")
    digest = hashlib.blake2b(str(location).encode(), digest_size=6).hexdigest()
    name = f"fedge_user_{location.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, location)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {location}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before executing it: dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
