"""Make the examples' model and data on first use (no hub here): run once, from the repo.

Writes ``runs/examples/tiny-qwen2/`` (a randomly initialized tiny Qwen2 with the demo's
character tokenizer and chat template, by ``save_pretrained``: a model folder like any
other), ``runs/examples/copy.jsonl`` / ``copy-chat.jsonl`` (4,096 rows each: copy
three digits; the prompt as text, or as one user message) and ``add.jsonl`` (4,096
sums of two numbers below 50, ``"12+34="`` -> ``"46"``). ``dew train`` then loads them
through the same code as a real checkpoint and dataset.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

OUT = Path("runs/examples")


def main() -> int:
    from dew.demo.model import make_model, make_tokenizer
    from dew.demo.tasks import make_prompts

    model_dir = OUT / "tiny-qwen2"
    if not (model_dir / "config.json").is_file():
        make_model("qwen2", "tiny", seed=0, max_positions=256).save_pretrained(model_dir)
        make_tokenizer().save_pretrained(model_dir)
        print(f"wrote {model_dir}")
    digits = make_prompts(4096, seed=0, min_digits=3, max_digits=3)
    pairs = random.Random(0)
    sums = [(pairs.randrange(50), pairs.randrange(50)) for _ in range(4096)]
    add = OUT / "add.jsonl"
    if not add.is_file():
        add.write_text(
            "".join(
                json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in sums
            )
        )
        print(f"wrote {add}")
    for name, row in (
        ("copy.jsonl", lambda d: {"prompt": f"{d}=", "answer": d}),
        ("copy-chat.jsonl", lambda d: {"messages": [{"role": "user", "content": d}], "answer": d}),
    ):
        path = OUT / name
        if not path.is_file():
            path.write_text("".join(json.dumps(row(d)) + "\n" for d in digits))
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
