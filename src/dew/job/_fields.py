"""``dew train --fields``: every field of the config with its type, default and help.

The help of a field is found where the field is written, so it is never kept twice:
the comment beside (or just above) it in :mod:`dew.job.config`, else the sentence of
its library type's docstring that names it (``SamplingParams``, ``SchedulerConfig``,
``GRPOObjective``, ``init_pool``, ``fit``).
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

__all__ = ["fields_text"]

_FIELD = re.compile(r"^\s+(\w+): [^#]*?(?:#\s*(.*))?$")
_COMMENT = re.compile(r"^\s+#\s?(.*)$")


def fields_text() -> str:
    """Every section's fields, one line each (what ``dew train --fields`` prints)."""
    from dew.core import SamplingParams
    from dew.job import config as c
    from dew.objectives.rl.config import SchedulerConfig
    from dew.objectives.rl.grpo import GRPOObjective
    from dew.pool import init_pool
    from dew.train import fit

    docs: dict[str, list[Any]] = {
        "sampling": [SamplingParams],
        "scheduler": [SchedulerConfig],
        "objective": [GRPOObjective],
        "parallel": [init_pool],
        "training": [fit],
        "output": [fit],
    }
    out = []
    for name, info in c.JobConfig.model_fields.items():
        section = info.annotation
        if typing.get_origin(section) is tuple:  # [[rewards]]: an array of tables
            section, name = typing.get_args(section)[0], f"[{name}]"
        out.append(f"[{name}]")
        comments = _comments(section)
        for field, spec in section.model_fields.items():
            kind = _kind(spec.annotation)
            value = spec.default_factory() if spec.default_factory else spec.default  # type: ignore[call-arg]
            default = "(required)" if spec.is_required() else f"= {_show(value)}"
            help_ = comments.get(field) or _from_docs(field, docs.get(name.strip("[]"), []))
            out.append(f"  {field}: {kind} {default}" + (f"  # {help_}" if help_ else ""))
        out.append("")
    return "\n".join(out)


def _comments(section: type) -> dict[str, str]:
    """The comment beside each field of ``section``'s source, else the block above it."""
    try:
        lines = inspect.getsource(section).splitlines()
    except (OSError, TypeError):  # made by create_model: no source of its own
        return {}
    found: dict[str, str] = {}
    above: list[str] = []
    for line in lines[1:]:
        comment = _COMMENT.match(line)
        if comment:
            above.append(comment.group(1))
            continue
        field = _FIELD.match(line)
        if field and not line.strip().startswith(("def ", "@", "return")):
            text = field.group(2) or " ".join(above)
            if text:
                found.setdefault(field.group(1), text.strip())
        above = []
    return found


def _from_docs(field: str, owners: list[Callable[..., Any] | type]) -> str:
    """The first sentence of the owners' docstrings that names ``field``."""
    for owner in owners:
        doc = " ".join((inspect.getdoc(owner) or "").split())
        for sentence in re.split(r"(?<=[.;])\s+", doc):
            if f"``{field}``" in sentence:
                return re.sub(r":\w+:`~?([^`]*)`", r"\1", sentence).replace("``", "")
    return ""


def _kind(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    return text or str(annotation).replace("typing.", "")


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)
