"""Writing a config back as TOML (the standard library reads TOML but does not write it).

Nested mappings become tables, sequences of mappings arrays of tables, and ``None`` (TOML
has no null) a commented-out line, so every field of a config is shown.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def toml_text(data: Mapping[str, Any], prefix: str = "") -> str:
    """``data`` (nested mappings, sequences of mappings, plain values) as TOML."""
    plain, tables = [], []
    for key, value in data.items():
        if isinstance(value, Mapping):
            tables.append(f"\n[{prefix}{key}]\n" + toml_text(value, f"{prefix}{key}."))
        elif (
            isinstance(value, (list, tuple))
            and value
            and all(isinstance(v, Mapping) for v in value)
        ):
            for item in value:
                tables.append(f"\n[[{prefix}{key}]]\n" + toml_text(item, f"{prefix}{key}."))
        elif value is None:  # TOML has no null: shown, as a comment, so every field is
            plain.append(f"# {key} = none\n")
        else:
            plain.append(f"{key} = {_toml_value(value)}\n")
    return "".join(plain) + "".join(tables)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
