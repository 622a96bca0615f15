"""The dataset of a ``dew train`` run: loaded from local files, checked row by row first.

``data.path`` is a ``.jsonl``/``.json``/``.parquet``/``.csv`` file or a folder written
by ``datasets``' ``save_to_disk`` (a ``DatasetDict``'s ``train`` split). The prompt
column holds text; a messages column holds chat messages (``[{"role", "content"},
...]``), rendered with the tokenizer's chat template. Every other column reaches the
reward functions.

Before anything runs, every row is checked: a missing or empty prompt, messages that
are not a list of role/content mappings, or a prompt whose tokens plus
``sampling.max_tokens`` exceed the model's context. Such rows are skipped and reported
by index (:class:`Rows` keeps them in ``skipped``); a dataset with no usable row is a
:class:`~dew.job.config.ConfigError`. Task ids are positions among the usable rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dew.job.config import ConfigError
from dew.objectives.rl.sources.chat import ChatTokens
from dew.objectives.rl.sources.prompts import encode_prompt

__all__ = ["Rows", "load_rows"]

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class Rows(Sequence[Mapping[str, Any]]):
    """The usable rows of a dataset, in order; ``rows[i]`` is task ``i``'s row."""

    table: Any  # a datasets.Dataset
    column: str
    usable: list[int]
    skipped: dict[int, str] = field(default_factory=dict)  # row index -> why
    prompt_tokens: int = 0  # the longest usable prompt, in tokens

    def __len__(self) -> int:
        return len(self.usable)

    def __getitem__(self, i: int) -> Mapping[str, Any]:  # type: ignore[override]
        return self.table[self.usable[i]]

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        return (self[i] for i in range(len(self)))

    def prompts(self) -> Sequence[Any]:
        """The prompt column of the usable rows, as PromptSource reads it."""
        return _Column(self)


class _Column(Sequence[Any]):
    def __init__(self, rows: Rows) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        return self._rows[i][self._rows.column]


def load_table(path: str, name: str = "data.path") -> Any:
    """The ``datasets.Dataset`` at ``path``; ConfigError naming ``name`` otherwise."""
    import datasets

    where = Path(path)
    try:
        if where.is_dir():
            loaded = datasets.load_from_disk(str(where))
            if isinstance(loaded, datasets.DatasetDict):
                if "train" not in loaded:
                    raise ConfigError(f"{name}: {path} has no 'train' split ({list(loaded)})")
                loaded = loaded["train"]
            return loaded
        if not where.is_file():
            raise ConfigError(f"{name}: {path}: no such file or folder")
        if where.stat().st_size == 0:
            raise ConfigError(f"{name}: {path} is empty")
        kind = _FORMATS.get(where.suffix.lower())
        if kind is None:
            raise ConfigError(f"{name}: {path}: expected one of {sorted(_FORMATS)} or a folder")
        return datasets.load_dataset(kind, data_files=str(where), split="train")
    except ConfigError:
        raise
    except Exception as exc:  # datasets' own parse errors, of many types
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ConfigError(f"{name}: {path} cannot be loaded: {why}") from None


def load_rows(
    path: str,
    *,
    column: str,
    chat: bool,
    tokenizer: Any,
    max_len: int,
    max_tokens: int,
    field: str = "data.path",
) -> Rows:
    """Load ``path`` and check every row against the model's context (module
    docstring); errors name ``field`` (the config field ``path`` came from)."""
    table = load_table(path, field)
    if column not in table.column_names:
        which = "messages_column" if chat else "prompt_column"
        raise ConfigError(
            f"data.{which}: {column!r} is not a column of {path} "
            f"(columns: {', '.join(table.column_names)})"
        )
    usable: list[int] = []
    skipped: dict[int, str] = {}
    longest = 0
    budget = max_len - max_tokens
    chat_tokens = ChatTokens(tokenizer) if chat else None
    try:
        for i, value in enumerate(table[column]):
            why, length = _check(value, chat_tokens, tokenizer, budget, max_tokens)
            if why is None:
                usable.append(i)
                longest = max(longest, length)
            else:
                skipped[i] = why
    except UnicodeDecodeError as exc:  # read lazily, row by row
        row = len(usable) + len(skipped)
        raise ConfigError(
            f"{field}: {path} is not UTF-8 text (row {row}: byte {exc.object[exc.start]:#04x} "
            f"at {exc.start})"
        ) from None
    if not usable:
        first = "; ".join(f"row {i}: {why}" for i, why in list(skipped.items())[:3])
        raise ConfigError(f"{field}: no usable row in {path} ({first})")
    return Rows(table, column, usable, skipped, longest)


def _check(
    value: Any, chat: ChatTokens | None, tokenizer: Any, budget: int, max_tokens: int
) -> tuple[str | None, int]:
    if chat is not None:
        if not isinstance(value, list) or not value:
            return "messages must be a non-empty list", 0
        if not all(isinstance(m, Mapping) and {"role", "content"} <= set(m) for m in value):
            return "each message must have a role and a content", 0
    elif not isinstance(value, str) or not value.strip():
        return "empty prompt", 0
    try:  # exactly as the source will encode it
        ids = encode_prompt(value, "prompt", tokenizer=tokenizer, chat=chat)
    except Exception as exc:  # a template or tokenizer failing on this row
        return f"cannot be encoded: {type(exc).__name__}: {exc}", 0
    if len(ids) > budget:
        return f"prompt of {len(ids)} tokens + {max_tokens} new ones exceeds the context", 0
    return None, len(ids)
