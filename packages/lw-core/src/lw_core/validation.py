"""Strict conversion into msgspec Structs with errors that name the key, the value and what the
field accepts, read from its type and ``Meta`` with ``msgspec.inspect`` (never from the wording of
msgspec's message). Used for ``kv_connector_extra_config`` (``lw_core.config``, each backend
plugin's keys) and for ``LayerPipeline``'s arguments, so a constraint is written once, on a field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, cast

import msgspec

S = TypeVar("S")


def convert_strict(
    data: Mapping[str, Any], typ: type[S], *, prefix: str, notes: Mapping[str, str] | None = None,
    error: type[Exception] = ValueError,
) -> S:
    """``msgspec.convert(data, typ, strict=True)``; a rejected value raises ``error`` with
    ``"{prefix}{key}={value!r} is not accepted; accepted: {what} ({note})"``."""
    try:
        return msgspec.convert(dict(data), typ, strict=True)
    except msgspec.ValidationError as e:
        raise error(explain(e, data, typ, prefix=prefix, notes=notes or {})) from None


def explain(e: msgspec.ValidationError, data: Mapping[str, Any], typ: type, *, prefix: str, notes: Mapping[str, str]) -> str:
    """Name the first rejected key: found by converting each value alone into its field's type,
    whose accepted values are read with ``msgspec.inspect``."""
    annotations = {f.name: f.type for f in msgspec.structs.fields(typ)}
    info = cast(msgspec.inspect.StructType, msgspec.inspect.type_info(typ))  # structs.fields took it
    infos = {f.name: f.type for f in info.fields}
    for key, value in data.items():
        if key not in annotations:
            return f"{prefix}unknown argument {key!r}; accepted: {', '.join(annotations)}"
        try:
            msgspec.convert(value, annotations[key], strict=True)
        except msgspec.ValidationError:
            note = notes.get(key) or ("seconds" if key.endswith("_s") else "")
            accepted = accepted_values(infos[key]) + (f" ({note})" if note else "")
            return f"{prefix}{key}={value!r} is not accepted; accepted: {accepted}"
    return f"{prefix.rstrip('.: ')}: {e}"


def accepted_values(t: msgspec.inspect.Type) -> str:
    """What a field's type accepts, in words (ranges from its ``Meta``)."""
    mi = msgspec.inspect
    if isinstance(t, mi.LiteralType):
        return ", ".join(map(repr, t.values))
    if isinstance(t, (mi.IntType, mi.FloatType)):
        kind = "an integer" if isinstance(t, mi.IntType) else "a finite number"
        parts = [f"{op} {v:g}" if isinstance(v, float) else f"{op} {v}"
                 for op, v in ((">=", t.ge), (">", t.gt), ("<=", t.le), ("<", t.lt)) if v is not None]
        return f"{kind} {' and '.join(parts)}".rstrip()
    if isinstance(t, mi.BoolType):
        return "a bool (true or false)"
    if isinstance(t, mi.StrType):
        return "a non-empty string" if t.min_length else "a string"
    if isinstance(t, mi.NoneType):
        return "null"
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        most = f" (at most {t.max_length} entries)" if t.max_length is not None else ""
        return f"a list{most} of: {accepted_values(t.item_type)}"
    if isinstance(t, mi.UnionType):
        return " or ".join(accepted_values(x) for x in t.types)
    return type(t).__name__
