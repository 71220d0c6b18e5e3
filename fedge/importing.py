"""Resolving ``package.module:name`` paths, as the CLI and config files name tasks and ClientApps."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_attribute"]


def import_attribute(path: str, what: str, error: type[ValueError] = ValueError) -> Any:
    """The object ``name`` of module ``package.module``, or None if the module has no such name.

    Raises ``error`` naming ``what`` if ``path`` is malformed or the module does not import (whatever the
    module itself raises: a user's module must not crash the coordinator or agent).
    """
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise error(f"{what} {path!r} is not of the form 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise error(f"{what} module {module_name!r} does not import: {err}") from err
    return getattr(module, attribute, None)
