"""Tokenizing one chat of many turns without {% generation %} markers (CPU, seconds a record).

The prefix renders (two template renders a reply, each of the conversation so far) grow with the square of the
turns; ``chat_turns._locate_linear`` (from ``chat_turns.LINEAR_FROM`` replies) renders ~8 times. Both are timed on the
same conversations with the embedded SmolLM2-135M-Instruct tokenizer and template, and their ids and masks compared.
Conversations: user and assistant turns of 3-30 words each, seeded.

    PYTHONPATH=src python benchmarks/bench_chat_turns.py [--turns 10 50 200 500] [--out DIR]
"""

from __future__ import annotations

import argparse
import random
import time

from chronicals import load_tokenizer
from chronicals.data import chat_turns
from chronicals.data.tokenize import encode_chat
from common import markdown_table, write_results


def conversation(turns: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = "salt harbor island north coast merchant grain river market winter lantern ship letter bridge".split()
    msgs = []
    for k in range(turns):
        msgs.append({"role": "user", "content": f"question {k}: " + " ".join(rng.choices(words, k=rng.randint(3, 20)))})
        msgs.append({"role": "assistant", "content": f"answer {k}: " + " ".join(rng.choices(words, k=rng.randint(3, 30)))})
    return msgs


def timed(tok, msgs, repeats: int, linear_from: int):
    saved, chat_turns.LINEAR_FROM = chat_turns.LINEAR_FROM, linear_from
    try:
        best, out = float("inf"), None
        for _ in range(repeats):
            t = time.perf_counter()
            out = encode_chat(tok, msgs)
            best = min(best, time.perf_counter() - t)
        return best, out
    finally:
        chat_turns.LINEAR_FROM = saved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, nargs="+", default=[10, 50, 200, 500])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tok = load_tokenizer("smollm2-135m-instruct")
    rows = []
    for turns in args.turns:
        msgs = conversation(turns, seed=turns)
        fast, a = timed(tok, msgs, args.repeats, chat_turns.LINEAR_FROM)
        slow, b = timed(tok, msgs, 1 if turns > 200 else args.repeats, 10 ** 9)
        same = a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()
        rows.append({"turns": turns, "tokens": len(a[0]), "shortcut_s": round(fast, 4), "prefix_renders_s": round(slow, 4),
                     "speedup": round(slow / fast, 1), "same_ids_and_mask": same})
        print(rows[-1], flush=True)
    md = ("Chat tokenization a record, SmolLM2 template (best of repeats; prefix renders once past 200 turns)\n\n"
          + markdown_table(rows, list(rows[0])))
    path = write_results("bench_chat_turns", {"rows": rows, "linear_from": chat_turns.LINEAR_FROM}, md, args.out)
    print(md)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
