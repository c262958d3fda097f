"""`chronicals bench`: every contender on the ANCHORS.md protocol, each in its own process, one report.

    chronicals bench                       # 0.5B table (full + LoRA), parity, learning, 8B LoRA table
    chronicals bench --quick               # under 5 minutes of GPU time (fewer contenders and steps)
    chronicals bench --shape 8b --contenders chronicals-lora,hf-peft
    chronicals bench --seq-sweep | --model-sweep | --max-context
    chronicals bench --device cpu --tiny   # the same code paths on a tiny model (tests, no GPU)
    chronicals bench --shape 0.5b --contenders chronicals-lora --graphs   # + the CUDA-graph step beside it

Exit status: 0; 1 when a row (its gradient norm not finite or 0) or the correctness / learning check is FAILED
(the files are written either way); 2 for bad arguments or no GPU for the protocol's shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import replace
from pathlib import Path

from .._cli_args import Parser
from ..cuda_alloc import allocator_env
from .contenders import CONTENDERS, get_contender, missing_requirements
from .protocol import RunSpec, validate_row
from .report import environment, finish_row, markdown_table, write_report
from .shapes import SHAPES, get_shape
from .worker import spec_argv

# --quick: the rows that answer "are we ahead" in < 5 min of GPU time; Liger/Unsloth rows cost nothing
# when not installed. Left out: chronicals/HF variants that compile (1-2 min each), unsloth-full, PEFT
# + Liger/compile, and the 8B table.
QUICK = ("chronicals-full", "chronicals-lora", "chronicals-lora-graphs", "hf-sdpa", "hf-compile", "hf-liger", "hf-peft",
         "unsloth-lora")
SWEEP_DEFAULT = ("chronicals-full", "chronicals-lora", "hf-compile", "hf-peft", "unsloth-lora")
LORA_SWEEP = ("chronicals-lora", "hf-peft", "unsloth-lora")
SEQ_SWEEP = (512, 1024, 2048, 4096, 8192, 16384)
SWEEP_SHAPES = ("0.5b", "1.5b", "3b", "8b")  # the model sweep and --max-context (issue 8)
TINY_SWEEP = (8, 16, 32)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding chronicals/


def parse_args(argv):
    ap = Parser(prog="chronicals bench", description=__doc__.split("\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help=f"0.5B table only, 2 + 6 steps, contenders {', '.join(QUICK)}")
    ap.add_argument("--shape", choices=list(SHAPES), help="one table at this shape (default: 0.5b and 8b)")
    ap.add_argument("--contenders", help=f"comma-separated subset of: {', '.join(CONTENDERS)}, "
                    "or chronicals-{full,lora}[-graphs]-gateup<k> (gate/up rebuilt in the first k layers); "
                    "without --shape each default table runs those of its methods (8b: LoRA ones)")
    ap.add_argument("--rows", type=int, help="sequences per step (default: the shape's protocol)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default: the shape's protocol)")
    ap.add_argument("--warmup", type=int, help="warm-up steps (default 4; --quick 2; --tiny 1)")
    ap.add_argument("--steps", type=int, help="timed steps (default 12; --quick 6; --tiny 2)")
    ap.add_argument("--device", help="cuda or cpu (default: cuda when a GPU is visible; without one, cpu for --tiny "
                                     "and --shape tiny, and the protocol's shapes stop and say so unless --device cpu "
                                     "is given)")
    ap.add_argument("--tiny", action="store_true", help="tiny model, 2 x 32 tokens: CPU tests of the harness")
    ap.add_argument("--impl", default="auto", choices=("auto", "triton", "torch"), help="chronicals op kernels")
    ap.add_argument("--step", default="trainer", choices=("trainer", "bench"),
                    help="chronicals step: the trainer's accumulate_gradients, or the bench's own call")
    ap.add_argument("--layout", default="rows", choices=("rows", "packed"),
                    help="chronicals batch: dense rows, or the packed contract (cu_seqlens, one doc per row)")
    ap.add_argument("--attention", default="auto", choices=("auto", "cudnn", "flash", "fa4"),
                    help="chronicals packed rows' attention kernel (model.attention); only with --layout packed, "
                    "but fa4 (FlashAttention-4, pip install flash-attn-4), which runs unpacked rows too")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing for every row")
    ap.add_argument("--graphs", action="store_true", help="add the CUDA-graph twin (chronicals-full-graphs, "
                    "chronicals-lora-graphs) after each chronicals-full / chronicals-lora row")
    ap.add_argument("--no-correctness", action="store_true", help="skip the parity check vs transformers")
    ap.add_argument("--no-learning", action="store_true", help="skip the learning check")
    ap.add_argument("--learning-steps", type=int, default=40)
    ap.add_argument("--learning-lr", type=float, help="full-FT lr of the learning check (default 3e-4; 3e-3 --tiny)")
    ap.add_argument("--seq-sweep", action="store_true", help=f"seq {SEQ_SWEEP[0]}..{SEQ_SWEEP[-1]} at fixed tokens per step")
    ap.add_argument("--model-sweep", action="store_true", help="LoRA at 0.5b, 1.5b, 3b, 8b (4 x 2048), or at "
                    "--shape only (--tiny: the tiny shape, 2 x 32); checkpointing on where a row runs out of memory "
                    "without it")
    ap.add_argument("--max-context", action="store_true", help="longest trainable seq per shape (1 row, checkpointing; "
                    "0.5b, 1.5b, 3b, 8b unless --shape)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per worker process")
    ap.add_argument("--name", help="result file stem (default: bench_e2e plus the plan, e.g. bench_e2e_quick)")
    ap.add_argument("--out", default="benchmarks/results",
                    help="result directory (default: benchmarks/results under the current directory)")
    return ap.parse_args(argv)


class Runner:
    """Launches worker processes and collects their JSON rows."""

    def __init__(self, timeout: int, log=print):
        self.timeout, self.log = timeout, log
        self.tmp = Path(tempfile.mkdtemp(prefix="chronicals-bench-"))
        self.count = 0
        # the workers' row files, read as they finish: removed with the runner (231 were left in /tmp)
        weakref.finalize(self, shutil.rmtree, str(self.tmp), True)

    def run(self, task: str, spec: RunSpec) -> dict:
        self.count += 1
        out = self.tmp / f"{self.count:03d}_{task}_{spec.contender}.json"
        cmd = [sys.executable, "-m", "chronicals.bench.worker", "--task", task, *spec_argv(spec), "--json-out", str(out)]
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if spec.contender.startswith("chronicals"):  # our CLI's allocator default; the anchors keep the user's
            env.update(allocator_env(env))
        # the worker imports this very package (whether installed or run with PYTHONPATH=src / sys.path)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, timeout=self.timeout, capture_output=True, text=True)
            tail = (proc.stdout + proc.stderr)[-3000:]
            try:
                row = json.loads(out.read_text()) if out.exists() else None
            except (OSError, ValueError) as e:  # a row the worker could not finish: this row fails, not the bench
                row = {"contender": spec.contender, "status": "crashed",
                       "reason": f"worker row {out} unreadable ({e}); exit {proc.returncode}: "
                                 f"{tail.strip().splitlines()[-1:]}"}
            if row is None:  # the process died before writing (segfault, illegal memory access, killed for memory)
                row = {"contender": spec.contender, "status": "crashed",
                       "reason": f"worker exited {proc.returncode} without a row: {tail.strip().splitlines()[-1:] }"}
            row["worker_log_tail"] = tail
        except subprocess.TimeoutExpired:
            row = {"contender": spec.contender, "status": "timeout", "reason": f"no result within {self.timeout} s"}
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        return row


def contender_rows(runner: Runner, names, base: RunSpec, peak) -> list[dict]:
    rows = []
    for name in names:
        c = get_contender(name)
        missing = missing_requirements(c)
        if missing:  # no process to start: the row says so
            row = {"contender": name, "status": "not installed", "reason": f"needs {', '.join(missing)}", "wall_s": 0}
        else:
            row = runner.run("contender", replace(base, contender=name))
        row.setdefault("label", c.label)
        row.setdefault("method", c.method)
        for k in ("shape", "rows", "seq", "checkpointing"):
            row.setdefault(k, getattr(base, k))
        row = finish_row(validate_row(row), peak)
        tps = f"{row['tokens_per_s']:,.0f} tok/s" if row.get("tokens_per_s") else ""
        runner.log(f"  {name:28s} {row['status']:14s} {tps:>16s}  {row.get('reason', '')[:120]}  ({row.get('wall_s', 0)} s)")
        rows.append(row)
    return rows


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_contenders(shape, quick: bool, device: str = "cuda") -> list[str]:
    """The default table's contenders for ``shape``; CUDA-graph rows only on a CUDA device."""
    names = [c.name for c in CONTENDERS.values() if c.in_default and c.method in shape.methods
             and (device.startswith("cuda") or not c.name.endswith("-graphs"))]
    return [n for n in names if n in QUICK] if quick else names


def with_graphs(names: list[str]) -> list[str]:
    """Insert ``<name>-graphs`` after every contender that has a CUDA-graph twin (once each)."""
    out = []
    for n in names:
        out.append(n)
        twin = f"{n}-graphs"
        if twin in CONTENDERS and twin not in names:
            out.append(twin)
    return out


def run_plan(args, save=None) -> dict:
    """Run the plan; ``save(results)`` after each table and check (the files of a run cut short keep them)."""
    save = save or (lambda results: None)
    tiny = args.tiny or args.shape == "tiny"  # --shape tiny is --tiny: its step counts and learning check too
    device = args.device or default_device()
    sweeping = args.seq_sweep or args.model_sweep or args.max_context
    warmup = args.warmup if args.warmup is not None else (1 if tiny else 2 if args.quick else 4)
    steps = args.steps if args.steps is not None else (2 if tiny else 6 if args.quick else 12)
    shapes = [args.shape] if args.shape else (["tiny"] if tiny else ["0.5b"] if args.quick else ["0.5b", "8b"])
    chosen = [s.strip() for s in args.contenders.split(",")] if args.contenders else None  # checked by check_args
    note = ("Sweep run: the protocol tables and the correctness / learning checks are left out (run without "
            "sweep flags for them)." if sweeping else "")
    if args.quick:
        note = (f"--quick: {warmup} warm-up + {steps} timed steps, contenders {', '.join(QUICK)}; skipped: the 8B "
                "table, compiled chronicals variants, unsloth-full, PEFT + Liger / compile.")
    runner = Runner(args.timeout)
    base = RunSpec("peak", shape=shapes[0], warmup=warmup, steps=steps, device=device, impl=args.impl, step=args.step,
                   layout=args.layout, attention=args.attention, checkpointing=args.checkpointing)
    peak_row = runner.run("peak", base) if device.startswith("cuda") else {"gpu": "cpu", "peak_tflops": None}
    peak = peak_row.get("peak_tflops")
    print(f"device {peak_row.get('gpu', device)}: bf16 matmul peak {peak or 'n/a'} TFLOP/s")
    results = {"environment": environment(peak_row.get("gpu") or device), "peak_tflops": peak, "peak": peak_row,
               "plan": {"warmup": warmup, "steps": steps, "quick": args.quick, "note": note, "argv": sys.argv[1:]},
               "tables": []}

    def spec_for(shape_name, rows=None, seq=None, **kw):
        sh = get_shape(shape_name)
        return replace(base, shape=shape_name, rows=rows or args.rows or sh.rows, seq=seq or args.seq or sh.seq, **kw)

    for name in [] if sweeping else shapes:
        sh = get_shape(name)
        spec = spec_for(name)
        # without --shape, each default table takes the named contenders of its methods: the 8B table is LoRA only
        # (a full fine-tune of 8B with AdamW holds ~128 GB of weights, gradients and moments before any activation)
        names = ([n for n in chosen if args.shape or get_contender(n).method in sh.methods] if chosen
                 else default_contenders(sh, args.quick, device))
        if not names:
            print(f"table {name}: skipped, no contender of --contenders is a {' or '.join(sh.methods)} one "
                  f"(--shape {name} runs them there anyway)")
            continue
        print(f"table {name}: {spec.rows} x {spec.seq} tokens per step")
        rows = contender_rows(runner, with_graphs(names) if args.graphs else names, spec, peak)
        results["tables"].append({"title": f"{sh.note}, {spec.rows} x {spec.seq} tokens per step", "shape": name,
                                  "rows": spec.rows, "seq": spec.seq, "rows_data": rows})
        print(markdown_table(rows))
        save(results)
    check_shape = shapes[0] if get_shape(shapes[0]).methods == ("full", "lora") else ("tiny" if tiny else "0.5b")
    if not (args.no_correctness or sweeping):
        spec = spec_for(check_shape, rows=min(args.rows or 4, 4) if not tiny else 2)
        results["correctness"] = runner.run("correctness", replace(spec, contender="correctness"))
        print(f"correctness: {results['correctness'].get('status')} {results['correctness'].get('reason', '')}".rstrip())
        save(results)
    if not (args.no_learning or sweeping):
        spec = spec_for(check_shape, rows=2 if tiny else 8, seq=32 if tiny else 512)
        lr = args.learning_lr or (3e-3 if tiny else 3e-4)
        results["learning"] = runner.run("learning", replace(spec, contender="learning", steps=args.learning_steps, lr=lr))
        print(f"learning: {results['learning'].get('status')} {results['learning'].get('reason', '')}".rstrip())
        save(results)
    if args.seq_sweep:
        sh = get_shape(shapes[0])
        tokens = (args.rows or sh.rows) * (args.seq or sh.seq)
        for seq in [s for s in (TINY_SWEEP if tiny else SEQ_SWEEP) if s <= tokens]:
            spec = spec_for(sh.name, rows=tokens // seq, seq=seq)
            print(f"seq sweep {sh.name}: {spec.rows} x {seq}")
            rows = contender_rows(runner, chosen or SWEEP_DEFAULT, spec, peak)
            results["tables"].append({"title": f"seq sweep, {sh.note}, {spec.rows} x {seq}", "shape": sh.name,
                                      "rows": spec.rows, "seq": seq, "rows_data": rows})
            save(results)
    if args.model_sweep:
        for name, n_rows, n_seq in model_sweep_plan(args):
            spec = spec_for(name, rows=n_rows, seq=n_seq)
            print(f"model sweep {name}: {spec.rows} x {spec.seq}, LoRA")
            rows = contender_rows(runner, chosen or LORA_SWEEP, spec, peak)
            retry = [r["contender"] for r in rows if r["status"] == "OOM"]
            if retry and not spec.checkpointing:  # checkpointing only where needed
                rows += contender_rows(runner, retry, replace(spec, checkpointing=True), peak)
            results["tables"].append({"title": f"model sweep, {get_shape(name).note}, LoRA, {spec.rows} x {spec.seq}",
                                      "shape": name, "rows": spec.rows, "seq": spec.seq, "rows_data": rows})
            save(results)
    if args.max_context:
        results["max_context"] = max_context(runner, shapes if args.shape or tiny else list(SWEEP_SHAPES),
                                             chosen or LORA_SWEEP, base, tiny)
    return results


def model_sweep_plan(args) -> list[tuple[str, int, int]]:
    """(shape, rows, seq) of each --model-sweep table: SWEEP_SHAPES at 4 x 2048, or --shape's alone; --tiny
    (or --shape tiny) the tiny shape alone at its own 2 x 32. --rows / --seq override the batch."""
    names = [args.shape] if args.shape else ["tiny"] if args.tiny else list(SWEEP_SHAPES)
    out = []
    for name in names:
        sh = get_shape(name)
        rows, seq = (sh.rows, sh.seq) if name == "tiny" else (4, 2048)
        out.append((name, args.rows or rows, args.seq or seq))
    return out


def max_context(runner: Runner, shapes, names, base: RunSpec, tiny: bool) -> list[dict]:
    """Double seq (1 row, checkpointing on, 1 + 1 steps) from 4096 (64 for tiny) until a row fails."""
    out = []
    for shape in shapes:
        for name in names:
            seq, best, failure, best_row, cap = (64 if tiny else 4096), None, "", {}, (256 if tiny else 1 << 18)
            while seq <= cap:
                row = runner.run("contender", replace(base, contender=name, shape=shape, rows=1, seq=seq,
                                                      warmup=1, steps=1, checkpointing=True))
                row = validate_row(row)
                print(f"  max context {shape} {name} seq {seq}: {row['status']}")
                if row["status"] != "ok":
                    failure = f"seq {seq}: {row['status']} {row.get('reason', '')[:80]}"
                    break
                best, best_row, seq = seq, row, seq * 2
            out.append({"shape": shape, "contender": name, "max_ok": best, "first_failure": failure, "cap": cap,
                        "peak_gib": best_row.get("peak_gib"), "tokens_per_s": best_row.get("tokens_per_s")})
    return out


def result_name(args) -> str:
    """bench_e2e[_quick][_<shape>][_seqsweep][_modelsweep][_maxctx]: runs of one day do not overwrite each other."""
    parts = ["bench_e2e"] + (["quick"] if args.quick else []) + ([args.shape] if args.shape else [])
    parts += [flag for flag, on in (("seqsweep", args.seq_sweep), ("modelsweep", args.model_sweep),
                                    ("maxctx", args.max_context)) if on]
    return "_".join(parts)


def check_args(args) -> str | None:
    """What is wrong with the arguments, or None: said before anything runs (an unknown contender was reported
    after the no-GPU message, or as a bad-input error, exit 3; --rows 0 silently took the protocol's rows)."""
    if args.contenders is not None:
        names = [s.strip() for s in args.contenders.split(",")]
        if not all(names):  # --contenders "" had run every contender
            return f"--contenders {args.contenders!r}: give comma-separated contender names, none empty"
        if len(set(names)) < len(names):
            return f"--contenders {args.contenders!r}: a contender is named twice"
        for n in names:
            try:
                get_contender(n)
            except ValueError as e:
                return f"--contenders: {e}"
    for flag, value, least in (("--rows", args.rows, 1), ("--seq", args.seq, 2), ("--warmup", args.warmup, 0),
                               ("--steps", args.steps, 1), ("--learning-steps", args.learning_steps, 1),
                               ("--timeout", args.timeout, 1)):
        if value is not None and value < least:
            return f"{flag} {value}: must be >= {least}"
    if args.tiny and args.shape and args.shape != "tiny":
        return "--tiny picks the tiny shape; drop --shape or --tiny"
    if args.learning_lr is not None and not 0 < args.learning_lr < float("inf"):  # nan too
        return f"--learning-lr {args.learning_lr}: must be a finite number > 0"
    if args.graphs and (args.device == "cpu" or (args.device is None and (args.tiny or args.shape == "tiny")
                                                 and default_device() == "cpu")):
        return "--graphs adds CUDA-graph rows, which need a GPU: drop it on the CPU"
    if args.attention not in ("auto", "fa4") and args.layout != "packed":
        return f"--attention {args.attention} chooses the packed rows' kernel: add --layout packed, or drop it"
    if args.device is not None:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
            return f"--device {args.device}: use cpu, cuda or cuda:N"
        if args.device.startswith("cuda") and default_device() == "cpu":
            return f"--device {args.device}: no CUDA GPU is visible here; use --device cpu with --tiny"
    if args.name is not None and (not args.name.strip() or re.search(r"[/\\]|^\.\.?$", args.name)):
        return f"--name {args.name!r}: a file stem, without '/' (the files go into --out)"
    out = Path(args.out).expanduser()
    for p in (out, *out.parents):  # said now, not after every contender has run
        if p.exists() and not p.is_dir():
            return f"--out {args.out}: {p} is a file, not a directory; give a directory for the result files"
    return None  # whether it can be written: out_problem, which tries (os.access says yes to root on a ro mount)


def out_problem(out_arg: str) -> str | None:
    """Why the result files could not be written to --out, found by making the directory and a file in it before
    any contender runs (a read-only --out failed after the whole run, the JSON lost: a bench walk; os.access
    answers yes to root on a read-only mount), or None."""
    out = Path(out_arg).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".bench-probe-"):
            pass
    except OSError as e:
        return f"--out {out_arg}: the result files cannot be written there ({e.strerror or e}); give a directory you can write"
    return None


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    problem = check_args(args)
    if problem:
        print(f"chronicals bench: error: {problem}", file=sys.stderr)
        return 2
    if args.device is None and not args.tiny and args.shape != "tiny" and default_device() == "cpu":
        # the protocol's shapes on the CPU only end in workers killed for memory (0.5B full at 16 x 1024 tokens)
        print("chronicals bench: no CUDA GPU is visible (torch.cuda.is_available() is False), and the "
              "protocol's shapes (Qwen2.5-0.5B and Llama-3-8B at 16 x 1024 / 4 x 2048 tokens) are GPU "
              "work; run it on a GPU, or `chronicals bench --device cpu --tiny` for the same code paths "
              "on a tiny model (--device cpu with a --shape forces a CPU run)", file=sys.stderr)
        return 2  # a usage error: 1 means "diverged" to train's callers
    problem = out_problem(args.out)
    if problem:
        print(f"chronicals bench: error: {problem}", file=sys.stderr)
        return 2
    name, held = args.name or result_name(args), {}

    def save(results: dict, complete: bool = False) -> dict:
        results["complete"] = complete
        paths = write_report(results, args.out, name, stem=held.get("stem"), chart=complete)
        held["stem"] = paths["json"].with_name(paths["json"].name[:-len(".json")])
        return paths

    results = run_plan(args, save)
    paths = save(results, complete=True)
    print("\n".join(f"wrote {p}" for p in paths.values()))
    failed = [f"{r['contender']} ({t['shape']})" for t in results["tables"] for r in t["rows_data"]
              if r.get("status") == "FAILED"]
    failed += [check for check in ("correctness", "learning") if results.get(check, {}).get("status") == "FAILED"]
    if failed:  # a wrapper could not tell a FAILED run from a good one (a bench walk)
        print(f"chronicals bench: FAILED: {', '.join(failed)} (exit status 1)", file=sys.stderr)
        return 1
    return 0
