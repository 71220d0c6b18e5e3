"""Configuration plumbing shared by every TOML-configured object: one error type, one reader.

Every configuration object in fedge is a dataclass. :func:`from_table` builds one from a TOML table (or a
mapping of flags), so unknown keys and wrong types are reported the same way everywhere, naming the dotted
key (``mqtt.transfer.max_buffered_bytes``); range checks stay in each dataclass's ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

__all__ = ["ConfigError", "check_types", "from_table", "read_secret", "read_toml", "shown"]

T = TypeVar("T")


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict = 2, 4, 4


def shown(value: object) -> str:
    """``repr(value)`` cut short for an error message: a value read from a file or the network may be a 20 MB
    string, a list nested 200,000 deep or an integer of thousands of digits."""
    try:
        return _SHOWN.repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return (
            f"an integer of about {value.bit_length() * 0.30103:.0f} digits"
            if isinstance(value, int)
            else "?"
        )


class ConfigError(ValueError):
    """A configuration key or value that fedge cannot use; the message names it."""


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; a missing or malformed file is a :class:`ConfigError` naming it."""
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from None


def read_secret(path: str | Path, what: str) -> str:
    """The first line of a secrets file, stripped (passwords and keys stay out of config files)."""
    try:
        return Path(path).read_text().splitlines()[0].strip()
    except (OSError, IndexError, UnicodeDecodeError) as err:
        raise ConfigError(f"{what} file {path} cannot be read: {err}") from None


def from_table(cls: type[T], table: Mapping[str, Any], *, where: str = "") -> T:
    """Build the dataclass ``cls`` from ``table``, checking every key and type.

    Parameters
    ----------
    cls : dataclass type
        The configuration object to build; nested dataclass fields are read from sub-tables.
    table : mapping
        Keys are field names, spelled with underscores or hyphens (``server_lr`` or ``server-lr``, as
        Flower's run config spells them); values are checked against the field's annotation (an int is
        accepted for a float, a table for a nested dataclass, a list of strings for a tuple of strings).
    where : str (default: "")
        The dotted name of ``table`` itself, prefixed to every key an error names.

    Raises
    ------
    ConfigError
        On an unknown key, a missing required key, a value of the wrong type, or a value the dataclass's
        own checks refuse; the message names the dotted key.
    """
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where or 'config'} must be a table, got {shown(table)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for spelled, value in table.items():
        key = spelled.replace("-", "_") if isinstance(spelled, str) else spelled
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown key {_dotted(where, spelled)!r}; known keys: {known}")
        if key in values:
            raise ConfigError(f"key {_dotted(where, key)!r} is given twice (with '_' and with '-')")
        values[key] = _coerce(hints[key], value, _dotted(where, spelled))
    missing = [
        name
        for name, f in fields.items()
        if name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing key {_dotted(where, missing[0])!r}")
    try:
        return cls(**values)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}" if where else str(err)) from None


def check_types(config: Any) -> None:
    """Check (and coerce, e.g. int to float) every field of a dataclass built directly in code.

    Call it first in ``__post_init__``: objects built by :func:`from_table` are checked there already,
    this covers ``SomeConfig(rounds="3")`` written in Python. Works on frozen dataclasses.
    """
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        coerced = _coerce(hints[f.name], value, f.name)
        if coerced is not value:
            object.__setattr__(config, f.name, coerced)


def _dotted(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _coerce(kind: Any, value: Any, dotted: str) -> Any:
    """``value`` as the annotation ``kind`` wants it, or a ConfigError naming ``dotted``."""
    origin, args = get_origin(kind), get_args(kind)
    if kind is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(option, value, dotted)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{dotted} has the wrong type: {shown(value)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{dotted} must be one of {', '.join(map(repr, args))}, got {shown(value)}")
        return value
    if dataclasses.is_dataclass(kind):
        return value if isinstance(value, kind) else from_table(kind, value, where=dotted)
    if origin in (dict, Mapping) or kind is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{dotted} must be a table, got {shown(value)}")
        return dict(value)
    if origin in (tuple, list):
        item = args[0] if args else Any
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{dotted} must be a list, got {shown(value)}")
        items = [_coerce(item, v, f"{dotted}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer of hundreds of digits
                raise ConfigError(f"{dotted} is too large a number, got {shown(value)}") from None
            if math.isnan(number):  # compares false with everything: a wait "until > nan" never ends
                raise ConfigError(f"{dotted} must be a number, got nan")
            return number
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(kind, type) and isinstance(value, kind):
        return value
    name = getattr(kind, "__name__", str(kind))
    raise ConfigError(f"{dotted} must be {name}, got {shown(value)}")


def make_state_dir(path: str | Path, what: str = "the state directory") -> Path:
    """Create a state directory (and its parents) if needed; a ConfigError naming it (``what``) if the OS
    refuses (a file in its place, no permission)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create {what} {path}: {err.strerror or err}") from None
    return path


def error_line(err: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, cut at ``limit`` characters ("..." marks the cut), for
    one-line errors; "" when it says nothing (numpy's EOFError on an empty file)."""
    lines = str(err).strip().splitlines()
    if not lines:
        return ""
    return lines[0] if len(lines[0]) <= limit else lines[0][:limit] + "..."
