"""Building codecs from spec strings and TOML tables.

Grammar (whitespace around tokens is ignored, names are case-insensitive)::

    spec     := pipeline [";" policy]
    pipeline := stage ("+" stage)*              at most one sparsifier or low-rank stage, first;
                                                 at most one value stage, last (default fp32)
    stage    := NAME [":" args]
    args     := arg ("," arg)*                  the first may be positional, the rest key=value
    policy   := key "=" value ("," key "=" value)*     keys: min, dense, patterns (a|b|c)

Stages (positional parameter first, defaults in brackets):

* sparsifiers: ``topk:density[,mode=fast|exact]``, ``randk:density[,unbiased=true]``,
  ``threshold:t``; low rank: ``powersgd:rank``;
* values: ``fp32`` (alias ``dense``), ``fp16``, ``bf16``, ``int8[:block=256]`` (alias ``blockint8``),
  ``int4[:block=64]`` (alias ``blockint4``), ``qsgd:bits[,bucket=512]``, ``sign`` (alias ``ternary``);
* shorthand: ``stc:density`` = ``topk:density+sign`` (Sparse Ternary Compression).

Examples: ``"topk:0.01+int8"``, ``"qsgd:4"``, ``"stc:0.01"``, ``"powersgd:2+fp16"``,
``"randk:0.01,unbiased=false+int8;min=4096,dense=fp16"``.

A mapping (e.g. the ``[codec]`` table of a TOML file) holds either ``spec = "…"`` or stage tables
``sparsify``, ``lowrank``, ``quantize`` (each a spec string or a table with ``name`` and parameters),
plus an optional ``policy`` table with the :class:`TensorPolicy` fields.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from fedge.compression.codec import Codec, TensorPolicy
from fedge.compression.errors import CodecConfigError
from fedge.compression.powersgd import PowerSGD
from fedge.compression.quantize import QSGD, BFloat16, BlockInt4, BlockInt8, Float16, Float32, Sign
from fedge.compression.sparsify import RandomK, Threshold, TopK

__all__ = ["build_codec"]

_SPARSIFIERS = (TopK, RandomK, Threshold)
_STAGES: dict[str, type] = {
    cls.name: cls
    for cls in (*_SPARSIFIERS, PowerSGD, Float32, Float16, BFloat16, BlockInt8, BlockInt4, QSGD, Sign)
}
_ALIASES = {"dense": "fp32", "blockint8": "int8", "blockint4": "int4", "ternary": "sign"}
_POLICY_KEYS = {"min": "min_elements", "dense": "dense", "patterns": "dense_patterns"}
_MAPPING_KEYS = ("spec", "sparsify", "lowrank", "quantize", "policy")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def build_codec(spec: str | Mapping[str, Any]) -> Codec:
    """Build a :class:`Codec` from a spec string or a TOML-style mapping (see the module docstring).

    Raises
    ------
    CodecConfigError
        One line naming the unknown stage, parameter or bad value.
    """
    if isinstance(spec, str):
        return _from_string(spec)
    if isinstance(spec, Mapping):
        return _from_mapping(spec)
    raise CodecConfigError(f"codec spec must be a string or a mapping, got {type(spec).__name__}")


def _from_string(text: str) -> Codec:
    pipeline, _, policy_text = text.partition(";")
    stages = [stage for part in pipeline.split("+") for stage in _parse_stage(part)]
    policy: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in policy_text.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or key not in _POLICY_KEYS:
            raise CodecConfigError(
                f"policy: expected key=value with key in {sorted(_POLICY_KEYS)}, got {item!r}"
            )
        policy[_POLICY_KEYS[key]] = value.split("|") if key == "patterns" else value
    return _assemble(stages, _make(TensorPolicy, "policy", policy, from_text=True))


def _parse_stage(text: str) -> list[Any]:
    name, _, arg_text = (s.strip() for s in text.partition(":"))
    name = _ALIASES.get(name.lower(), name.lower())
    if not name:
        raise CodecConfigError(f"empty stage in codec spec (stages are joined by '+'): {text!r}")
    args: dict[str, Any] = {}
    for i, item in enumerate(filter(None, (a.strip() for a in arg_text.split(",")))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq:
            if i:
                raise CodecConfigError(f"{name}: only the first parameter may omit its name, got {item!r}")
            key, value = "", key
        args[key] = value
    if name == "stc":  # top-k and sign: an error names the stage the user wrote, not its top-k
        try:
            return [_stage("topk", args, from_text=True), Sign()]
        except CodecConfigError as err:
            raise CodecConfigError(f"stc: {str(err).removeprefix('topk: ')}") from None
    return [_stage(name, args, from_text=True)]


def _stage(name: str, args: Mapping[str, Any], *, from_text: bool) -> Any:
    cls = _STAGES.get(name)
    if cls is None:
        known = sorted({*_STAGES, *_ALIASES, "stc"})
        raise CodecConfigError(f"unknown codec stage {name!r}; known: {', '.join(known)}")
    args = dict(args)
    if "" in args:
        names = [f.name for f in dataclasses.fields(cls)]
        if not names:
            raise CodecConfigError(f"{name} takes no parameters, got {args['']!r}")
        args[names[0]] = args.pop("")
    return _make(cls, name, args, from_text=from_text)


def _make(cls: type, what: str, args: Mapping[str, Any], *, from_text: bool) -> Any:
    """Instantiate dataclass ``cls`` from ``args``, converting (text) or checking (TOML) each type."""
    # dataclasses.fields() leaves out ClassVars (a stage's ``name``), which no spec may set
    fields = {f.name for f in dataclasses.fields(cls)}
    hints = {f: t for f, t in typing.get_type_hints(cls).items() if f in fields}
    unknown = sorted(set(args) - set(hints))
    if unknown:
        raise CodecConfigError(f"{what}: unknown parameter {unknown[0]!r}; expected one of {sorted(hints)}")
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    missing = [name for name in required if name not in args]
    if missing:
        raise CodecConfigError(f"{what}: missing parameter {missing[0]!r}")
    kwargs = {key: _convert(what, key, value, hints[key], from_text) for key, value in args.items()}
    return cls(**kwargs)


def _convert(what: str, key: str, value: Any, kind: Any, from_text: bool) -> Any:
    if kind == tuple[str, ...]:
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(v.strip() for v in value)
        raise CodecConfigError(f"{what}: {key} must be a list of strings, got {value!r}")
    if from_text and isinstance(value, str) and kind is not str:
        try:
            if kind is bool:
                if value.lower() not in (*_TRUE, *_FALSE):
                    raise ValueError(value)
                return value.lower() in _TRUE
            return kind(value)
        except ValueError:
            raise CodecConfigError(f"{what}: {key} must be {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not kind:
        raise CodecConfigError(f"{what}: {key} must be {kind.__name__}, got {value!r}")
    return value


def _assemble(stages: list[Any], policy: TensorPolicy) -> Codec:
    structural = [s for s in stages if isinstance(s, (*_SPARSIFIERS, PowerSGD))]
    values = [s for s in stages if not isinstance(s, (*_SPARSIFIERS, PowerSGD))]
    if len(structural) > 1 or len(values) > 1:
        raise CodecConfigError("a codec has at most one sparsifier or low-rank stage and one value stage")
    if structural and stages[0] is not structural[0]:
        raise CodecConfigError(f"{structural[0].name} must come before the value stage")
    first = structural[0] if structural else None
    return Codec(
        sparsifier=first if isinstance(first, _SPARSIFIERS) else None,
        lowrank=first if isinstance(first, PowerSGD) else None,
        values=values[0] if values else Float32(),
        policy=policy,
    )


def _from_mapping(table: Mapping[str, Any]) -> Codec:
    unknown = sorted(set(table) - set(_MAPPING_KEYS))
    if unknown:
        expected = ", ".join(_MAPPING_KEYS)
        raise CodecConfigError(f"codec table: unknown key {unknown[0]!r}; expected {expected}")
    policy_table = table.get("policy", {})
    if not isinstance(policy_table, Mapping):
        raise CodecConfigError("codec table: policy must be a table")
    if "spec" in table:
        if any(key in table for key in ("sparsify", "lowrank", "quantize")):
            raise CodecConfigError("codec table: give either spec or stage tables, not both")
        if not isinstance(table["spec"], str):
            raise CodecConfigError("codec table: spec must be a string")
        codec = _from_string(table["spec"])
        stages = [s for s in (codec.sparsifier, codec.lowrank, codec.values) if s is not None]
        policy_table = {**dataclasses.asdict(codec.policy), **policy_table}
    else:
        stages = []
        for key in ("sparsify", "lowrank", "quantize"):
            entry = table.get(key)
            if isinstance(entry, str):
                stages += _parse_stage(entry)
            elif isinstance(entry, Mapping):
                args = {k: v for k, v in entry.items() if k != "name"}
                stage_name = str(entry.get("name", "")).lower()
                stages.append(_stage(_ALIASES.get(stage_name, stage_name), args, from_text=False))
            elif entry is not None:
                raise CodecConfigError(f"codec table: {key} must be a spec string or a table")
    return _assemble(stages, _make(TensorPolicy, "policy", policy_table, from_text=False))
