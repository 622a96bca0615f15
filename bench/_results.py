"""Shared by the benchmark scripts: how a machine is described, and writing one section
of bench/RESULTS.md while keeping every other section as it is."""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(*extra: str) -> str:
    """CPU model, CPU count, OS and Python, then whatever versions the caller adds."""
    parts = [
        cpu_model(),
        f"{os.cpu_count()} CPUs",
        f"{platform.system()} {platform.release()}",
        f"Python {platform.python_version()}",
        *extra,
    ]
    return ", ".join(parts)


def command_line(script: str) -> str:
    """The command that started this run, as it would be typed in the repository root."""
    return shlex.join([".venv/bin/python", f"bench/{script}", *sys.argv[1:]])


def provenance(script: str, seconds: float, *versions: str) -> dict[str, Any]:
    """How this run was made: its command, machine, date, wall time and the load at the
    end (these machines are shared); kept beside saved results for a later render."""
    return {
        "command": command_line(script),
        "machine": machine(*versions),
        "date": datetime.date.today().isoformat(),
        "seconds": seconds,
        "load": os.getloadavg()[0],
    }


def _commands(run: Mapping[str, Any]) -> list[str]:
    """The run's command, or commands when several invocations saved into one folder."""
    return run["command"] if isinstance(run["command"], list) else [run["command"]]


def joined_provenance(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """The provenance of a folder that invocations saved into, ``before`` (one or more
    of them) then ``after``: every command, the wall times added, each date and machine
    once."""
    seconds = [run.get("seconds") for run in (before, after)]

    def both(key: str) -> str:
        seen = before[key].split("; ")
        return before[key] if after[key] in seen else f"{before[key]}; {after[key]}"

    return {
        "command": [*_commands(before), after["command"]],
        "machine": both("machine"),
        "date": both("date"),
        "seconds": None if None in seconds else sum(seconds),
        "load": after.get("load"),
    }


def provenance_lines(run: Mapping[str, Any]) -> str:
    """A section's ``- command``, ``- machine`` and ``- date`` lines for ``run``
    (:func:`provenance`; an optional ``note`` follows the command)."""
    commands = _commands(run)
    # a section made of several invocations (kept in one folder) lists each of them
    command = "; ".join(f"`{c}`" for c in commands)
    when = f"- date: {run['date']}"
    if run.get("seconds") is not None:
        when += f", wall time {run['seconds']:.0f} s"
    if run.get("load") is not None:
        when += f", 1-minute load average at the end {run['load']:.1f}"
    return (
        f"- command{'s' if len(commands) > 1 else ''}: {command}{run.get('note', '')}\n"
        f"- machine: {run['machine']}\n{when}\n"
    )


def write_section(text: str, path: Path = RESULTS) -> None:
    """Replace the section that ``text`` opens (its first line, ``## name``), or append it."""
    header = text.splitlines()[0]
    if not header.startswith("## "):
        raise ValueError(f"a section starts with '## name', got {header!r}")
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    section = text.rstrip("\n") + "\n"
    pattern = re.compile(rf"^{re.escape(header)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(old):
        new = pattern.sub(lambda _: section + "\n", old, count=1).rstrip("\n") + "\n"
    else:
        new = old.rstrip("\n") + "\n\n" + section
    path.write_text(new)


SUMMARY_HEADER = (
    "## summary\n\n"
    "One row per benchmark, written by the benchmark itself when run with `--write` "
    "(its section below has the command, machine and date).\n\n"
    "| benchmark | measured | target | status |\n"
    "|---|---|---|---|\n"
)


def write_summary_row(
    name: str, measured: str, target: str, status: str, path: Path = RESULTS
) -> None:
    """Set the summary table's row for ``name`` (added when missing), keeping the others."""
    row = f"| {name} | {measured} | {target} | {status} |"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    section = re.search(r"^## summary\n.*?(?=^## |\Z)", text, re.S | re.M)
    if section is None:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n{SUMMARY_HEADER}\n{rest.lstrip(chr(10))}"
        section = re.search(r"^## summary\n.*?(?=^## |\Z)", text, re.S | re.M)
        assert section is not None
    body = section.group(0)
    lines = body.rstrip("\n").split("\n")
    mine = [i for i, line in enumerate(lines) if line.startswith(f"| {name} |")]
    if mine:
        lines[mine[0]] = row
    else:
        last = max(i for i, line in enumerate(lines) if line.startswith("|"))
        lines.insert(last + 1, row)
    new_body = "\n".join(lines) + "\n\n"
    path.write_text(text[: section.start()] + new_body + text[section.end() :])
