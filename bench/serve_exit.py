"""How long an idle ``dew serve`` takes to be gone after SIGTERM, side by side: the
server as it runs (``python -m dew.serve``: once its own things are closed it ends its
process at once) and the same server ending through the interpreter's normal teardown
(``sys.exit(main(...))``), which is what it did before.

Each run starts a server (``--demo tiny`` on 127.0.0.1, port 0), waits for ``/health``,
sends SIGTERM and times until the process is reaped (this script is its parent, so the
reap is immediate). The two ways alternate ``--repeats`` times; the figures are the
median and the range. ``--write`` replaces the ``## dew serve: stopping`` section of
bench/RESULTS.md; ``--tiny`` is one run each way that writes nothing.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import provenance, provenance_lines, write_section

WAYS = {
    "ends its process (python -m dew.serve)": ["-m", "dew.serve"],
    "interpreter teardown (sys.exit(main()))": [
        "-c",
        "import sys; from dew.serve import main; sys.exit(main(sys.argv[1:]))",
    ],
}


def once(argv: list[str]) -> float:
    """Seconds from SIGTERM to the reaped process, for one idle server."""
    proc = subprocess.Popen(
        [sys.executable, *argv, "--demo", "tiny", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "dew serve: listening on URL"
        url = line.strip().rsplit(" ", 1)[-1]
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        return time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--write", action="store_true")
    p.add_argument("--tiny", action="store_true", help="one run each way; writes nothing")
    args = p.parse_args()
    if args.tiny:
        args.repeats, args.write = 1, False
    started = time.monotonic()
    took: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way, argv in WAYS.items():
            took[way].append(once(argv))
    base = statistics.median(took[next(iter(WAYS))])
    rows = [
        f"| {way} | {statistics.median(t) * 1000:,.0f} | {min(t) * 1000:,.0f}-"
        f"{max(t) * 1000:,.0f} | {statistics.median(t) / base:.2f}x |"
        for way, t in took.items()
    ]
    import torch

    run = provenance("serve_exit.py", time.monotonic() - started, f"torch {torch.__version__}")
    text = (
        "## dew serve: stopping\n\n"
        + provenance_lines(run)
        + f"\nAn idle `dew serve --demo tiny`, SIGTERM to reaped, {args.repeats} runs each way, "
        "alternating.\n\n"
        "| how the process ends | median ms | range ms | vs ending its process |\n"
        "|---|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
        "Profile (py-spy 0.4, `record --native` at 200 Hz over the shutdown, written by "
        "hand): after uvicorn returned, the main thread spent its samples in "
        "`gc_collect_main` and object deallocation, the interpreter's final collection "
        "of the heap that torch and transformers leave, not in any of dew's own closing. "
        "The server therefore ends its process (`os._exit`) once `main` has closed "
        "everything it owns and flushed its output.\n"
    )
    print(text)
    if args.write:
        write_section(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
