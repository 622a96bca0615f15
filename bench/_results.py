"""Shared by the benchmark scripts: how a machine is described, and writing one section
of bench/RESULTS.md while keeping every other section as it is."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

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
