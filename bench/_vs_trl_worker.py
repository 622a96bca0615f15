"""One timed training run of bench/vs_trl.py, in its own process.

``python bench/_vs_trl_worker.py SPEC_JSON OUT_PATH`` pins torch to ``spec.threads``
threads, runs the spec's system (dew or TRL) and writes the
:class:`_vs_trl_common.RunResult` as JSON to ``OUT_PATH``. The orchestrator runs one
worker at a time, so the two systems never compete for the cores.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_vs_trl_*.py

from _vs_trl_common import RunResult, RunSpec


def run(spec: RunSpec) -> RunResult:
    import torch

    torch.set_num_threads(spec.threads)
    if spec.system == "dew":
        from _vs_trl_dew import run_dew

        result = run_dew(spec)
    else:
        from _vs_trl_trl import run_trl

        result = run_trl(spec)
    # ru_maxrss is in KiB on Linux: the process's peak, set-up and training together
    result.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit("usage: _vs_trl_worker.py SPEC_JSON OUT_PATH")
    spec = RunSpec.from_json(sys.argv[1])
    result = run(spec)
    if not result.rewards:
        raise SystemExit(f"{spec.system} {spec.task} seed {spec.seed}: no step finished")
    Path(sys.argv[2]).write_text(result.to_json())


if __name__ == "__main__":
    main()
