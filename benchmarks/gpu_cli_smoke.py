"""The CLI end to end on a GPU: `chronicals train` (LoRA and full, CUDA graphs auto), then `eval`, `chat` and
`export` on what it wrote (a full run's step checkpoint as --model too), each in its own process as a user runs them, on a small random model built here
(the lent GPU machine has no model hub and no embedded model: a Qwen2-style decoder with a BPE tokenizer trained
on the packaged demo data, ChatML template). Checks each command's exit status, that train ran on CUDA with the
allocator default it prints (expandable segments unless PYTORCH_CUDA_ALLOC_CONF is set), that the loss fell,
and that eval and chat ran without gradients (the separate q/k/v and gate/up path). Writes every log to OUT.

Usage: python benchmarks/gpu_cli_smoke.py OUT_DIR   (needs PYTHONPATH with src; ~1-2 min on an H200)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def build_model(out: Path) -> Path:
    """A 4-layer random Qwen2-style model (hidden 256) with a byte-level BPE tokenizer trained on the demo data."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import chronicals
    from chronicals.models import CausalLM, ModelConfig

    demo = Path(chronicals.__file__).parent / "demo_data" / "train.jsonl"
    texts = [m["content"] for line in demo.read_text().splitlines() for m in json.loads(line)["messages"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=["<|im_start|>", "<|im_end|>",
                                                                                      "<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    cfg = transformers.Qwen2Config(vocab_size=len(fast), hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                   max_position_embeddings=2048, eos_token_id=fast.eos_token_id)
    model = CausalLM(ModelConfig.from_hf_dict(cfg.to_dict())).init_weights(seed=0)
    return chronicals.save_model(model, fast, out / "base")


def run(name: str, args: list[str], logs: Path, env: dict) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "chronicals.cli", *args], capture_output=True, text=True, env=env,
                       timeout=300)
    text = f"$ chronicals {' '.join(args)}\nexit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    (logs / f"cli_{name}.txt").write_text(text)
    return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0


def main(out_dir: str) -> int:
    logs = Path(out_dir)
    logs.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    results, ok = [], True

    def check(name, cond, detail=""):
        nonlocal ok
        ok &= bool(cond)
        results.append(f"{'ok  ' if cond else 'FAIL'} {name}{': ' + detail if detail else ''}")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = build_model(tmp)
        common = [f"model.path={base}", "data.path=demo", "data.max_seq_len=256", "data.batch_size=8",
                  "train.save_every=20", "eval.every=20", "eval.qa=false"]
        for method, extra in (("lora", ["lora.enabled=true", "lora.rank=8", "optim.lr=2e-3"]),
                              ("full", ["lora.enabled=false", "optim.lr=3e-4"])):
            run_dir = tmp / f"run_{method}"
            rc, text, s = run(f"train_{method}", ["train", *common, *extra, "train.max_steps=40",
                                                  f"train.out_dir={run_dir}", "train.resume=none"], logs, env)
            check(f"train {method} exit 0 ({s:.0f} s)", rc == 0, "" if rc == 0 else text[-400:])
            check(f"train {method} on cuda with expandable segments",
                  "CUDA allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text)
            check(f"train {method} replays CUDA graphs", "train.cuda_graphs=auto: on" in text)
            metrics = run_dir / "metrics.jsonl"
            losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r] \
                if metrics.exists() else []
            check(f"train {method} loss fell", len(losses) >= 2 and losses[-1] < losses[0],
                  f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "no metrics")
            model_args = (["--adapter", str(run_dir / "adapter")] if method == "lora"
                          else ["--model", str(run_dir / "model")])
            rc, text, s = run(f"eval_{method}", ["eval", "demo", *model_args, "--json", str(logs / f"eval_{method}.json"),
                                                 "--qa-limit", "4"], logs, env)
            check(f"eval {method} exit 0 ({s:.0f} s)", rc == 0, "" if rc == 0 else text[-400:])
            # 24 new tokens: generate's auto choice replays a captured decode step from 16 on (models/decode_graph.py);
            # -v: chat logs that choice (without it, answers only)
            rc, text, s = run(f"chat_{method}", ["chat", "-v", *model_args, "--max-new-tokens", "24",
                                                 "What is the capital of Vellmora?"], logs, env)
            check(f"chat {method} exit 0 ({s:.0f} s)", rc == 0, "" if rc == 0 else text[-400:])
            check(f"chat {method} decoded through a CUDA graph", "one CUDA-graph replay per new token" in text)
            if method == "full":  # a step's model: its checkpoint as --model (export, chat)
                step40 = run_dir / "checkpoints" / "step-000040"
                rc, text, s = run("export_step", ["export", "--model", str(step40), "--out", str(tmp / "step40")],
                                  logs, env)
                check(f"export --model of a full run's checkpoint exit 0 ({s:.0f} s)", rc == 0,
                      "" if rc == 0 else text[-400:])
                if rc == 0:
                    from safetensors.torch import load_file

                    a, b = (load_file(str(d / "model.safetensors")) for d in (tmp / "step40", run_dir / "model"))
                    check("the last checkpoint's export equals the run's model/",
                          a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a))
                rc, text, s = run("chat_step", ["chat", "--model", str(run_dir / "checkpoints" / "step-000020"),
                                                "--max-new-tokens", "8", "What is the capital of Vellmora?"], logs, env)
                check(f"chat --model of a full run's step-20 checkpoint exit 0 ({s:.0f} s)", rc == 0,
                      "" if rc == 0 else text[-400:])
            if method == "lora":
                rc, text, s = run("export", ["export", "--adapter", str(run_dir / "adapter"), "--out",
                                             str(tmp / "merged")], logs, env)
                check(f"export exit 0 ({s:.0f} s)", rc == 0 and (tmp / "merged" / "config.json").exists(),
                      "" if rc == 0 else text[-400:])
                rc, text, s = run("eval_merged", ["eval", "demo", "--model", str(tmp / "merged"), "--json",
                                                  str(logs / "eval_merged.json"), "--qa-limit", "4"], logs, env)
                check(f"eval merged exit 0 ({s:.0f} s)", rc == 0, "" if rc == 0 else text[-400:])
    summary = "\n".join(results) + f"\n{'ALL OK' if ok else 'SOME FAILED'}\n"
    (logs / "cli_smoke_summary.txt").write_text(summary)
    print(summary)
    return 0 if ok else 1


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])  # --help ran the smoke into ./--help
    ap.add_argument("out_dir", nargs="?", default="cli_smoke_out", help="where every log goes")
    sys.exit(main(ap.parse_args().out_dir))
