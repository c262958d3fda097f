"""The contender runner on the tiny model on CPU: the same code paths as the GPU bench; an out-of-memory error
is an OOM row; a worker's cut-off JSON row (a full disk while the worker wrote it) is that
row "crashed" with the reason, not the whole bench ended by a bare JSON error."""

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from chronicals.bench import cli, worker
from chronicals.bench.contenders import get_contender
from chronicals.bench.protocol import LR_FULL, LR_LORA, RunSpec
from chronicals.bench.shapes import get_shape
from chronicals.bench.worker import run_contender, run_task

TINY = dict(shape="tiny", rows=2, seq=16, warmup=1, steps=2, device="cpu")


def tiny_build(name, **spec):
    """get_contender(name) built on the tiny shape on CPU (``spec``: RunSpec fields beside the tiny shape's; a
    device among them builds there)."""
    spec = RunSpec(name, **{"shape": "tiny", "rows": 2, "seq": 16, "device": "cpu", **spec})
    return get_contender(name).build(spec, get_shape("tiny"), torch.device(spec.device))


NAMES = {"chronicals-full": "full", "chronicals-lora": "lora", "hf-sdpa": "full", "hf-peft": "lora"}


@pytest.fixture(scope="module")
def rows():
    return {name: run_contender(RunSpec(name, **TINY)) for name in NAMES}


@pytest.mark.parametrize("name", list(NAMES))
def test_contender_row(rows, name):
    row, method = rows[name], NAMES[name]
    assert row["status"] == "ok", row.get("traceback", row["reason"])
    assert row["method"] == method and row["loss_tokens_per_step"] == 2 * 15
    assert len(row["losses"]) == 3 and len(row["grad_norms"]) == 2 and row["min_grad_norm"] > 0
    assert row["tokens_per_s"] > 0 and row["peak_gib"] is None  # CPU: no allocator peak
    # random tokens over 512 ids: the first loss sits near ln(512) = 6.24 for every contender
    assert abs(row["losses"][0] - 6.24) < 0.2


def test_lora_rows_train_only_adapters(rows):
    full, lora, peft = rows["chronicals-full"], rows["chronicals-lora"], rows["hf-peft"]
    # 7 projections x 2 layers x (A: r x in + B: out x r); r = 32 on hidden 64 / inter 128
    assert lora["trainable_params"] == peft["trainable_params"] < full["trainable_params"]
    assert lora["flops_per_token"] < full["flops_per_token"]


def test_default_and_quick_contenders():
    """The default table runs exactly the in_default contenders (not the compiled variants, 1-2 minutes each), and
    --quick exactly those of them in QUICK."""
    from chronicals.bench.contenders import CONTENDERS
    from chronicals.bench.shapes import get_shape

    full = cli.default_contenders(get_shape("0.5b"), False, "cuda")
    assert full == [n for n, c in CONTENDERS.items() if c.in_default]
    assert "chronicals-full-compile" not in full and "hf-sdpa" in full
    quick = cli.default_contenders(get_shape("0.5b"), True, "cuda")
    assert quick == [n for n in full if n in cli.QUICK] and "unsloth-full" not in quick and "hf-peft" in quick


def test_gate_up_dial_takes_any_k_and_trains_as_the_plain_row(rows):
    """chronicals-lora-gateup<k>: the same losses as chronicals-lora (the rebuilt gate/up output is the same GEMM)."""
    from chronicals.bench.contenders import get_contender

    c = get_contender("chronicals-lora-graphs-gateup7")
    assert c.method == "lora" and "7 layers" in c.label and not c.in_default
    row = run_contender(RunSpec("chronicals-lora-gateup1", **TINY))
    assert row["status"] == "ok", row.get("traceback", row["reason"])
    assert any("gate_up in the first 1 layers" in n for n in row["notes"]), row["notes"]
    assert row["losses"] == pytest.approx(rows["chronicals-lora"]["losses"], rel=1e-5)
    for bad in ("chronicals-lora-gateup0", "chronicals-lora-gateup", "chronicals-lora-gateup-3"):
        with pytest.raises(ValueError, match="gateup<k>"):
            get_contender(bad)


def test_dropout_rows_group_or_not_train_alike(rows):
    """chronicals-lora[-nogroup]-dropout: LoRA dropout 0.1, with LoRA groups (per-member masks) or one call per
    projection. The same seed draws the same masks, so the two rows' losses agree, and differ from the row
    without dropout once the adapters have trained a step."""
    from chronicals.bench.contenders import CONTENDERS

    assert {"chronicals-lora-graphs-dropout", "chronicals-lora-graphs-nogroup-dropout"} <= set(CONTENDERS)
    grouped = run_contender(RunSpec("chronicals-lora-dropout", **TINY))
    apart = run_contender(RunSpec("chronicals-lora-nogroup-dropout", **TINY))
    for row in (grouped, apart):
        assert row["status"] == "ok", row.get("traceback", row["reason"])
        assert any("LoRA dropout 0.1" in n for n in row["notes"]), row["notes"]
    # the GEMMs sum in other blocks: ~4e-5 apart after a step, as chronicals-lora and -nogroup are; dropout
    # itself moves the loss ~5e-4 (0.003)
    assert grouped["losses"] == pytest.approx(apart["losses"], rel=1e-4)
    assert abs(grouped["losses"][1] - rows["chronicals-lora"]["losses"][1]) > 1e-3


def test_failures_become_rows():
    row = run_contender(RunSpec("no-such-contender", **TINY))
    assert row["status"] == "error" and "unknown contender" in row["reason"]
    row = run_contender(RunSpec("chronicals-full", **dict(TINY, device="meta")))
    assert row["status"] == "error" and row["traceback"]


def test_a_worker_for_a_contender_not_installed_says_so_without_building(monkeypatch):
    """A worker started by hand for a contender whose packages are missing writes a "not installed" row naming them,
    with the FLOP count, and builds nothing."""
    from chronicals.bench import contenders

    monkeypatch.setattr(contenders, "missing_requirements", lambda c: ["nopkg"])
    row = run_contender(RunSpec("chronicals-full", **TINY))
    assert row["status"] == "not installed" and row["reason"] == "needs nopkg"
    assert row["flops_per_token"] > 0 and "losses" not in row and "build_s" not in row


def test_ctrl_c_in_a_contender_stops_the_worker(monkeypatch):
    """KeyboardInterrupt propagates out of run_contender: Ctrl-C stops the worker, it is not written as an error
    row for the bench to go on after."""
    from chronicals.bench import shapes

    def interrupted(name):
        raise KeyboardInterrupt
    monkeypatch.setattr(shapes, "get_shape", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_contender(RunSpec("chronicals-full", **TINY))


def test_a_lora_injection_that_freezes_nothing_is_refused(monkeypatch):
    """add_chronicals_lora refuses an injection that left every parameter trainable (base weights not frozen), not
    only one that left none: the LoRA row would otherwise time a full fine-tune."""
    import chronicals.lora
    from chronicals.bench.contenders import add_chronicals_lora

    monkeypatch.setattr(chronicals.lora, "apply_lora", lambda model, **kw: model)  # injects nothing, freezes nothing
    with pytest.raises(RuntimeError, match="apply_lora left 2 of 2 parameters trainable"):
        add_chronicals_lora(torch.nn.Linear(4, 4), RunSpec("chronicals-lora"))


@pytest.mark.parametrize("lr, want_a", [(0.0, 1e-4), (3e-4, 3e-4)])
def test_lora_groups_take_the_runs_lr(tiny_hf_config, lr, want_a):
    """The LoRA+ groups start from RunSpec.lr (the worker's --lr), 0 meaning the protocol's LR_LORA (1e-4), with B
    at 16x A, as hf-peft and the full contenders read it; they carried LR_LORA whatever --lr said."""
    from chronicals.bench.contenders import add_chronicals_lora
    from chronicals.models import CausalLM, ModelConfig

    model = CausalLM(ModelConfig.from_hf_dict(tiny_hf_config("qwen2")))
    groups = {g["name"]: g["lr"] for g in add_chronicals_lora(model, RunSpec("chronicals-lora", lr=lr))}
    assert groups["lora_A"] == pytest.approx(want_a) and groups["lora_B"] == pytest.approx(16 * want_a)


@pytest.mark.parametrize("name, lr, want", [("hf-peft", 0.0, LR_LORA), ("hf-sdpa", 0.0, LR_FULL),
                                            ("hf-peft", 2e-3, 2e-3)])
def test_hf_contenders_start_at_their_methods_lr(name, lr, want):
    """The hf contenders' one optimizer group starts at RunSpec.lr, 0 meaning the protocol's lr of the method:
    LR_LORA (1e-4) for hf-peft, LR_FULL (1e-5) for hf-sdpa; hf-peft trained at the full lr when it took LR_FULL."""
    lrs = [g["lr"] for g in tiny_build(name, lr=lr).optimizer.param_groups]
    assert lrs and all(g == pytest.approx(want) for g in lrs), lrs


def test_the_packed_layout_has_one_document_per_row():
    """The packed layout's cu_seqlens are the B + 1 boundaries [0, S, ..., B*S], int32 (the varlen kernels read the
    last one as the total length; the packed rows run only on a GPU); the rows layout has none."""
    from chronicals.bench.contenders import rows_as_packed_batch

    ids = torch.arange(12).reshape(3, 4)
    b = rows_as_packed_batch(ids, "packed")
    assert b.cu_seqlens.tolist() == [0, 4, 8, 12] and b.cu_seqlens.dtype == torch.int32
    assert rows_as_packed_batch(ids, "rows").cu_seqlens is None
    assert b.num_loss_tokens == 9 and b.num_tokens == 12


def test_worker_process_writes_row(tmp_path):
    runner = cli.Runner(timeout=300)
    row = runner.run("contender", RunSpec("chronicals-full", **TINY))
    assert row["status"] == "ok", row.get("worker_log_tail")
    assert row["min_grad_norm"] > 0 and row["wall_s"] > 0


def fake_worker(calls, rows):
    """subprocess.run stand-in for Runner.run: records (cmd, kw) in ``calls`` and writes the next of ``rows`` to
    --json-out (exit 0), or no row where it is None (exit -9, "Killed" on stderr)."""
    def run(cmd, **kw):
        calls.append((cmd, kw))
        row = rows.pop(0) if rows else None
        if row is not None:
            Path(cmd[cmd.index("--json-out") + 1]).write_text(json.dumps(row))
        return subprocess.CompletedProcess(cmd, 0 if row is not None else -9, "out\n", "Killed\n")
    return run


def test_a_worker_starts_offline_on_this_package_within_the_timeout(monkeypatch):
    """Runner.run starts each worker with HF_HUB_OFFLINE=1 even where the caller's environment says 0 (the bench
    builds from configs; the worker's own setdefault covers only an unset variable), with the folder holding this
    chronicals package first on PYTHONPATH and the caller's after it (a checkout that is not installed started
    workers that could not import it), and bounded by --timeout (a hung worker hung the bench)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("PYTHONPATH", "/some/user/path")
    calls = []
    monkeypatch.setattr(cli.subprocess, "run", fake_worker(calls, [{"contender": "chronicals-full", "status": "ok"}]))
    cli.Runner(timeout=7).run("contender", RunSpec("chronicals-full", **TINY))
    ((cmd, kw),) = calls
    assert kw["timeout"] == 7 and kw["env"]["HF_HUB_OFFLINE"] == "1"
    assert kw["env"]["PYTHONPATH"].split(os.pathsep) == [str(cli.PACKAGE_ROOT), "/some/user/path"]


def test_a_worker_past_the_timeout_is_a_timeout_row(monkeypatch):
    """A worker still running at --timeout is a "timeout" row naming the limit (it was never exercised: a
    "crashed" row passed), with its wall time."""
    def hang(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(cli.subprocess, "run", hang)
    row = cli.Runner(timeout=3).run("contender", RunSpec("chronicals-full", **TINY))
    assert row["status"] == "timeout" and row["reason"] == "no result within 3 s" and row["wall_s"] >= 0


def test_a_contender_not_installed_starts_no_worker(monkeypatch):
    """contender_rows: a contender whose packages are missing is a "not installed" row naming them, and no worker
    process is started for it (the worker said so too, but only after a process start and its imports)."""
    class Runner:
        log = staticmethod(lambda *a: None)

        def run(self, task, spec):
            raise AssertionError("a worker was started for a contender that is not installed")

    monkeypatch.setattr(cli, "missing_requirements", lambda c: ["nopkg"])
    (row,) = cli.contender_rows(Runner(), ["hf-peft"], RunSpec("hf-peft", **TINY), None)
    assert row["status"] == "not installed" and row["reason"] == "needs nopkg" and row["method"] == "lora"


def test_a_false_bool_field_reaches_the_worker_off():
    """spec_argv writes a bool field's flag only when it is on: the worker's store_true flags cannot be turned
    off, so a flag written for False ran every row with checkpointing."""
    spec = RunSpec("chronicals-full", shape="tiny", device="cpu", checkpointing=False)
    argv = worker.spec_argv(spec)
    assert "--checkpointing" not in argv
    args = worker.parse_args(["--json-out", "x.json", *argv])
    assert RunSpec(**{k: getattr(args, k) for k in spec.to_dict()}) == spec


@pytest.mark.parametrize("argv, contender, says", [
    (["--task", "contender", "--contender", "chronicals-full", "--rows", "0"], "chronicals-full", "rows=0"),
    (["--task", "contender", "--contender", "chronicals-full", "--seq", "1"], "chronicals-full", "seq=1"),
    # no --contender (a hand run): the row is named after the task
    (["--task", "correctness", "--rows", "0"], "correctness", "rows=0"),
])
def test_the_worker_writes_arguments_runspec_refuses_as_an_error_row(tmp_path, argv, contender, says):
    """worker.main turns arguments RunSpec refuses into an "error" row, written and exit 0 (a traceback left no
    row), and makes --json-out's missing folders."""
    out = tmp_path / "a" / "b" / "row.json"
    assert worker.main([*argv, "--json-out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["status"] == "error" and says in row["reason"] and row["contender"] == contender


def test_a_worker_run_by_hand_is_offline_unless_told_otherwise(tmp_path, monkeypatch):
    """A worker started by hand (no bench runner setting it) runs with HF_HUB_OFFLINE=1; a value the caller set
    stays."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    argv = ["--task", "contender", "--contender", "chronicals-full", "--rows", "0", "--json-out", str(tmp_path / "r")]
    assert worker.main(argv) == 0 and os.environ["HF_HUB_OFFLINE"] == "1"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert worker.main(argv) == 0 and os.environ["HF_HUB_OFFLINE"] == "0"


def test_each_check_task_runs_its_own_check(monkeypatch):
    from chronicals.bench import checks

    monkeypatch.setattr(checks, "correctness", lambda spec: {"task": "correctness", "status": "ok"})
    monkeypatch.setattr(checks, "learning", lambda spec: {"task": "learning", "status": "ok"})
    spec = RunSpec("x", **TINY)
    assert run_task("correctness", spec)["task"] == "correctness" and run_task("learning", spec)["task"] == "learning"

    def boom(spec):
        raise RuntimeError("boom")

    monkeypatch.setattr(checks, "learning", boom)  # a check that raises is an error row, never a worker without one
    row = run_task("learning", spec)
    assert (row["task"], row["status"], row["reason"]) == ("learning", "error", "RuntimeError: boom")


def test_the_peak_task_names_the_device_and_its_measured_peak(monkeypatch):
    import chronicals.train.metrics

    monkeypatch.setattr(chronicals.train.metrics, "matmul_peak_tflops", lambda device: 123.0)
    row = run_task("peak", RunSpec("peak", **TINY))
    assert (row["gpu"], row["peak_tflops"], row["status"]) == ("cpu", 123.0, "ok")


def test_main_tiny_end_to_end(tmp_path, monkeypatch, capsys):
    """main() with the workers run in this process (the subprocess path is tested above)."""
    def inprocess(self, task, spec):
        return json.loads(json.dumps(run_task(task, spec), default=str))

    monkeypatch.setattr(cli.Runner, "run", inprocess)
    cli.main(["--device", "cpu", "--tiny", "--seq", "16", "--contenders", "chronicals-full,hf-sdpa,hf-liger",
              "--no-learning", "--no-correctness", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    liger_line = next(line for line in out.splitlines() if line.strip().startswith("hf-liger"))
    (js,) = tmp_path.glob("bench_e2e_cpu_*.json")
    res = json.loads(js.read_text())
    rows = {r["contender"]: r for r in res["tables"][0]["rows_data"]}
    assert rows["chronicals-full"]["status"] == "ok" and rows["hf-sdpa"]["status"] == "ok"
    assert rows["hf-liger"]["status"] in ("not installed", "ok", "error")
    assert rows["hf-liger"]["status"] in liger_line  # the console line says what became of it
    assert "correctness" not in res and res["plan"]["steps"] == 2
    assert res["environment"]["versions"]["torch"]
    md = js.with_suffix(".md").read_text()
    assert "| chronicals | full |" in md
    # where Liger is installed (the GPU host's carried wheels) its row ran: its Triton kernels refuse CPU tensors
    assert rows["hf-liger"]["status"] != "not installed" or "not installed" in md
    assert js.with_suffix(".png").exists()


def test_sweeps_tiny(tmp_path, monkeypatch):
    monkeypatch.setattr(cli.Runner, "run", lambda self, task, spec: run_task(task, spec))
    cli.main(["--device", "cpu", "--tiny", "--seq-sweep", "--max-context", "--contenders", "chronicals-full",
              "--out", str(tmp_path)])
    (js,) = tmp_path.glob("bench_e2e_seqsweep_maxctx_cpu_*.json")
    res = json.loads(js.read_text())
    assert [(t["rows"], t["seq"]) for t in res["tables"]] == [(8, 8), (4, 16), (2, 32)]  # 64 tokens per step
    assert all(t["rows_data"][0]["status"] == "ok" for t in res["tables"])
    assert "correctness" not in res and "learning" not in res  # sweeps replace the protocol run
    (mc,) = res["max_context"]
    assert mc["contender"] == "chronicals-full" and mc["max_ok"] == 256  # 64, 128, 256 all train on CPU
    assert mc["cap"] == 256 and mc["tokens_per_s"] > 0  # the longest row's own numbers ride along
    md = next(tmp_path.glob("bench_e2e_seqsweep_maxctx_cpu_*.md")).read_text()
    assert "| tiny | chronicals-full | 256 | n/a |" in md and "256 is the cap |" in md


def test_max_context_checks_each_rows_gradient_norms_again():
    """A worker row said "ok" with a NaN gradient norm at seq 128: the longest context is 64, and the failure names
    it, as the tables re-check every worker row."""
    class Runner:
        def run(self, task, spec):
            norm = 1.0 if spec.seq < 128 else float("nan")
            return {"contender": spec.contender, "status": "ok", "grad_norms": [norm], "losses": [2.0, 1.0],
                    "tokens_per_s": 5.0 * spec.seq}

    (mc,) = cli.max_context(Runner(), ["tiny"], ["chronicals-full"], RunSpec("x", **TINY), tiny=True)
    assert mc["max_ok"] == 64 and mc["tokens_per_s"] == 320.0
    assert mc["first_failure"] == "seq 128: FAILED gradient norm not finite in 1 timed step"


def plan_calls(monkeypatch, argv):
    """run_plan(argv) with no process started: returns (tasks, tables), tasks the Runner.run calls (task, spec)
    and tables the contender_rows calls (names, spec)."""
    tasks, tables = [], []

    class Runner:
        def __init__(self, timeout):
            self.log = lambda *a: None

        def run(self, task, spec):
            tasks.append((task, spec))
            return {"contender": spec.contender, "status": "ok", "gpu": "fake", "peak_tflops": 100.0}

    monkeypatch.setattr(cli, "Runner", Runner)
    monkeypatch.setattr(cli, "contender_rows",
                        lambda runner, names, spec, peak: tables.append((list(names), spec)) or [])
    cli.run_plan(cli.parse_args(argv))
    return tasks, tables


@pytest.mark.parametrize("argv, tables", [
    ([], [("0.5b", 4, 12), ("8b", 4, 12)]),  # 0.5b (full + LoRA), then 8b (LoRA only)
    (["--quick"], [("0.5b", 2, 6)]),  # the < 5 minute plan
    (["--shape", "0.5b"], [("0.5b", 4, 12)]),
])
def test_the_default_plans_tables_and_step_counts(monkeypatch, argv, tables):
    """Without --shape the bench runs the 0.5b table then the 8b one (--quick: 0.5b only), each with the default
    contenders of its methods, for 4 warm-up + 12 timed steps (--quick: 2 + 6)."""
    _, ran = plan_calls(monkeypatch, ["--device", "cpu", "--no-correctness", "--no-learning", *argv])
    assert [(s.shape, s.warmup, s.steps) for _, s in ran] == tables
    for names, s in ran:
        assert names == cli.default_contenders(get_shape(s.shape), "--quick" in argv, "cpu")
        assert names and all(get_contender(n).method in get_shape(s.shape).methods for n in names)


def test_given_step_counts_are_the_plans_a_zero_warm_up_too(monkeypatch):
    """--warmup 0 (a real choice: the timed window then holds the first steps) and --steps replace the defaults in
    every table and check spec but the learning check's own steps."""
    tasks, ran = plan_calls(monkeypatch, ["--device", "cpu", "--tiny", "--warmup", "0", "--steps", "3"])
    assert [(s.warmup, s.steps) for _, s in ran] == [(0, 3)]
    assert [(t, s.warmup, s.steps) for t, s in tasks] == [("correctness", 0, 3), ("learning", 0, 40)]


@pytest.mark.parametrize("argv, tables, skipped", [
    (["--contenders", "chronicals-full"], [("0.5b", ["chronicals-full"])], True),
    (["--contenders", "chronicals-full,chronicals-lora"],
     [("0.5b", ["chronicals-full", "chronicals-lora"]), ("8b", ["chronicals-lora"])], False),
    (["--shape", "8b", "--contenders", "chronicals-full"], [("8b", ["chronicals-full"])], False),
    # on a GPU without --graphs: exactly the named ones, no CUDA-graph twin added
    (["--device", "cuda", "--tiny", "--contenders", "chronicals-full,chronicals-lora"],
     [("tiny", ["chronicals-full", "chronicals-lora"])], False),
    # with --graphs: each CUDA-graph twin right after its row
    (["--device", "cuda", "--tiny", "--graphs", "--contenders", "chronicals-full,hf-sdpa"],
     [("tiny", ["chronicals-full", "chronicals-full-graphs", "hf-sdpa"])], False),
])
def test_named_contenders_run_in_the_default_tables_of_their_method(monkeypatch, capsys, argv, tables, skipped):
    """Without --shape, each default table takes those of --contenders whose method is one of its shape's: the 8B
    table is LoRA only (a full fine-tune named there ran at 8B and ran out of memory), and a table left with none
    is skipped with a line saying so. With --shape the named contenders run there whatever its methods."""
    device = [] if "--device" in argv else ["--device", "cpu"]  # an option given twice is refused
    _, ran = plan_calls(monkeypatch, [*device, "--no-correctness", "--no-learning", *argv])
    assert [(s.shape, names) for names, s in ran] == tables
    assert ("table 8b: skipped, no contender of --contenders is a lora one" in capsys.readouterr().out) == skipped


@pytest.mark.parametrize("device, peak", [("cuda:1", [("peak", "cuda:1")]), ("cuda", [("peak", "cuda")]),
                                          ("cpu", [])])
def test_the_matmul_peak_is_measured_on_any_cuda_device(monkeypatch, device, peak):
    """The bf16 matmul peak (MFU's denominator) is measured on the run's CUDA device, cuda:N included (MFU was
    n/a on --device cuda:1), and not on the CPU."""
    tasks, _ = plan_calls(monkeypatch, ["--device", device, "--tiny", "--no-correctness", "--no-learning"])
    assert [(t, s.device) for t, s in tasks] == peak


@pytest.mark.parametrize("argv, checks", [
    # 8b is LoRA only: both checks need full and LoRA, so they run at 0.5b
    (["--shape", "8b"], [("correctness", "0.5b", 4, 1024, 0.0, 12), ("learning", "0.5b", 8, 512, 3e-4, 40)]),
    # correctness: at most 4 rows; --rows caps it lower, never raises it
    (["--shape", "0.5b", "--rows", "16"], [("correctness", "0.5b", 4, 1024, 0.0, 12),
                                           ("learning", "0.5b", 8, 512, 3e-4, 40)]),
    (["--shape", "0.5b", "--rows", "2"], [("correctness", "0.5b", 2, 1024, 0.0, 12),
                                          ("learning", "0.5b", 8, 512, 3e-4, 40)]),
    (["--tiny"], [("correctness", "tiny", 2, 32, 0.0, 2), ("learning", "tiny", 2, 32, 3e-3, 40)]),
    (["--tiny", "--learning-lr", "1e-2", "--learning-steps", "5"],
     [("correctness", "tiny", 2, 32, 0.0, 2), ("learning", "tiny", 2, 32, 1e-2, 5)]),
])
def test_the_correctness_and_learning_checks_specs(monkeypatch, argv, checks):
    """The checks' (shape, rows, seq, lr, steps): on a shape with full and LoRA (else 0.5b), correctness at most 4
    rows (2 for --tiny); learning 8 x 512 at lr 3e-4 (--tiny: 2 x 32 at 3e-3) for --learning-steps steps, lr
    overridden by --learning-lr."""
    tasks, _ = plan_calls(monkeypatch, ["--device", "cpu", *argv])
    assert [(t, s.shape, s.rows, s.seq, s.lr, s.steps) for t, s in tasks] == checks
    assert [s.contender for _, s in tasks] == ["correctness", "learning"]


def test_bench_without_a_gpu_says_how_to_run(tmp_path, monkeypatch, capsys):
    """No GPU and no --device/--tiny: a clear message at once, not rows of workers killed for memory; exit 2 (a
    SystemExit with the message gave 1, which means "diverged" to train's callers). --shape tiny runs on the CPU
    as --tiny does: the stop is for the protocol's shapes only."""
    monkeypatch.setattr(cli, "default_device", lambda: "cpu")
    assert cli.main(["--quick"]) == 2
    assert re.search(r"no CUDA GPU is visible .*chronicals bench --device cpu --tiny", capsys.readouterr().err)
    ran = []
    monkeypatch.setattr(cli, "run_plan", lambda args, save=None: ran.append(args.shape) or {"tables": []})
    monkeypatch.setattr(cli, "write_report", lambda results, out, name, stem=None, chart=False:
                        {"json": tmp_path / "r.json"})
    assert cli.main(["--shape", "tiny", "--out", str(tmp_path)]) == 0 and ran == ["tiny"]
    assert "no CUDA GPU" not in capsys.readouterr().err


def test_device_help_says_what_runs_without_a_gpu(capsys):
    """--help said the default was cpu without a GPU, where the protocol's shapes stop instead (the test above)."""
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "cpu for --tiny and --shape tiny, and the protocol's shapes stop and say so unless --device cpu" in out


@pytest.mark.parametrize("argv, says", [
    (["--contenders", "chronicals-full,nope"], "--contenders: unknown contender 'nope'"),
    (["--device", "cpu", "--tiny", "--rows", "0"], "--rows 0: must be >= 1"),  # was the protocol's rows, silently
    (["--device", "cpu", "--tiny", "--steps", "0"], "--steps 0: must be >= 1"),
    (["--device", "cpu", "--tiny", "--seq", "1"], "--seq 1: must be >= 2"),
    (["--device", "cpu", "--tiny", "--warmup", "-1"], "--warmup -1: must be >= 0"),
    (["--device", "cpu", "--tiny", "--learning-steps", "0"], "--learning-steps 0: must be >= 1"),
    (["--device", "cpu", "--tiny", "--timeout", "0"], "--timeout 0: must be >= 1"),
    (["--tiny", "--shape", "0.5b"], "--tiny picks the tiny shape"),
    # each of these ran every contender first (or ran nonsense) and failed or wrote outside --out
    (["--device", "cpu", "--tiny", "--contenders", ""],
     "--contenders '': give comma-separated contender names, none empty"),
    (["--device", "cpu", "--tiny", "--contenders", "chronicals-full,chronicals-full"],
     "--contenders 'chronicals-full,chronicals-full': a contender is named twice"),
    (["--device", "cpu", "--tiny", "--attention", "cudnn"], "--attention cudnn chooses the packed rows' kernel"),
    (["--device", "cpu", "--tiny", "--learning-lr", "nan"], "--learning-lr nan: must be a finite number > 0"),
    (["--device", "cpu", "--tiny", "--learning-lr", "0"], "--learning-lr 0.0: must be a finite number > 0"),
    (["--device", "cpu", "--tiny", "--learning-lr", "inf"], "--learning-lr inf: must be a finite number > 0"),
    (["--device", "cpu", "--tiny", "--graphs"], "--graphs adds CUDA-graph rows, which need a GPU"),
    (["--tiny", "--graphs"], "--graphs adds CUDA-graph rows, which need a GPU"),  # the default device: cpu here
    (["--shape", "tiny", "--graphs"], "--graphs adds CUDA-graph rows, which need a GPU"),
    (["--device", "tpu", "--tiny"], "--device tpu: use cpu, cuda or cuda:N"),
    (["--device", "cuda:x", "--tiny"], "--device cuda:x: use cpu, cuda or cuda:N"),
    (["--device", "cuda", "--tiny"], "--device cuda: no CUDA GPU is visible here; use --device cpu with --tiny"),
    (["--device", "cuda:0", "--tiny"], "--device cuda:0: no CUDA GPU is visible here"),
    (["--device", "cpu", "--tiny", "--name", "a/b"], "--name 'a/b': a file stem, without '/'"),
    (["--device", "cpu", "--tiny", "--name", "a\\b"], "--name 'a\\\\b': a file stem"),  # a folder on Windows
    (["--device", "cpu", "--tiny", "--name", ".."], "--name '..': a file stem"),
    (["--device", "cpu", "--tiny", "--name", "."], "--name '.': a file stem"),
    (["--device", "cpu", "--tiny", "--name", ""], "--name '': a file stem"),
    (["--device", "cpu", "--tiny", "--name", "   "], "--name '   ': a file stem"),  # files ' _cpu_<date>.json'
    (["--device", "cpu", "--tiny", "--out", "{tmp}/afile"],
     "--out {tmp}/afile: {tmp}/afile is a file, not a directory"),
    (["--device", "cpu", "--tiny", "--out", "{tmp}/afile/sub/dir"],
     "--out {tmp}/afile/sub/dir: {tmp}/afile is a file, not a directory"),
])
def test_bad_arguments_are_said_before_anything_runs(argv, says, tmp_path, monkeypatch, capsys):
    """Exit 2 with the argument named, before the no-GPU check or any worker (an unknown contender came after the
    no-GPU message on a CPU machine, and as a bad-input error, exit 3, with --device cpu). On a machine without a
    GPU; every case writes under tmp_path, so a check that let its case through cannot write result files into
    the repository."""
    (tmp_path / "afile").write_text("x")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    monkeypatch.setattr(cli, "default_device", lambda: "cpu")

    def run_plan(args, save=None):
        raise AssertionError(f"{argv} passed the argument checks and would have run")
    monkeypatch.setattr(cli, "run_plan", run_plan)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"chronicals bench: error: {says.replace('{tmp}', str(tmp_path))}" in err
    assert "torch.cuda.is_available()" not in err  # not the no-GPU stop's message


@pytest.mark.parametrize("argv, gpu", [
    # the least values: a 0-warm-up run is a real choice
    (["--device", "cpu", "--tiny", "--rows", "1", "--seq", "2", "--warmup", "0", "--steps", "1",
      "--learning-steps", "1", "--timeout", "1"], False),
    (["--device", "cpu", "--tiny", "--layout", "packed", "--attention", "cudnn"], False),
    (["--device", "cpu", "--tiny", "--layout", "packed", "--attention", "flash"], False),
    (["--tiny", "--graphs"], True),  # the default device is then cuda
    (["--shape", "tiny", "--graphs"], True),
    (["--device", "cuda"], True),
    (["--device", "cuda:1"], True),
    (["--device", "cpu", "--tiny", "--name", "run.1"], False),
    (["--device", "cpu", "--tiny", "--shape", "tiny"], False),  # --tiny and the shape it picks agree
    (["--device", "cpu", "--tiny", "--name", ".x"], False),
    (["--device", "cpu", "--tiny", "--name", "..."], False),
])
def test_good_arguments_pass_the_checks(argv, gpu, tmp_path, monkeypatch):
    """The checks above refuse only what is wrong: the least allowed values, --attention with --layout packed (the
    packed rows' kernel), --graphs and --device cuda[:N] where a GPU is visible, and --name stems that only start
    with dots all pass."""
    monkeypatch.setattr(cli, "default_device", lambda: "cuda" if gpu else "cpu")
    assert cli.check_args(cli.parse_args([*argv, "--out", str(tmp_path)])) is None


def test_the_result_files_stem_names_the_plan_or_is_the_name(tmp_path, monkeypatch):
    """The result files' stem is bench_e2e[_quick][_<shape>][_seqsweep][_modelsweep][_maxctx], so a --quick run
    does not write over a full run of the same day; --name replaces it (it was ignored)."""
    assert cli.result_name(cli.parse_args([])) == "bench_e2e"
    assert cli.result_name(cli.parse_args(["--quick"])) == "bench_e2e_quick"
    assert cli.result_name(cli.parse_args(["--quick", "--shape", "0.5b", "--seq-sweep", "--model-sweep",
                                           "--max-context"])) == "bench_e2e_quick_0.5b_seqsweep_modelsweep_maxctx"
    names = []
    monkeypatch.setattr(cli, "run_plan", lambda args, save=None: {"tables": []})
    monkeypatch.setattr(cli, "write_report", lambda results, out, name, stem=None, chart=False:
                        names.append(name) or {"json": tmp_path / f"{name}_cpu.json"})
    assert cli.main(["--device", "cpu", "--tiny", "--name", "mine", "--out", str(tmp_path)]) == 0
    assert names == ["mine"]


@pytest.mark.parametrize("error, status, says", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "OOM", "out of memory"),
    # an optional package half installed: its row says so, not "error"
    (ModuleNotFoundError("No module named 'liger_kernel.ops'"), "not installed", "liger_kernel.ops"),
])
def test_an_out_of_memory_or_import_error_is_its_own_row_status(error, status, says):
    try:
        raise error
    except Exception as e:
        row = worker._error_row({"contender": "x"}, e)
    assert row["status"] == status and says in row["reason"]


def test_an_error_rows_reason_is_its_first_line_cut_at_300():
    """An error row's reason is the exception's type and the headline of its message (its first line, not the
    last), at most 300 characters."""
    for message, reason in (("the headline\nsecond line\nthird", "RuntimeError: the headline"),
                            ("y" * 1000, ("RuntimeError: " + "y" * 1000)[:300])):
        try:
            raise RuntimeError(message)
        except RuntimeError as e:
            row = worker._error_row({"contender": "x"}, e)
        assert row["status"] == "error" and row["reason"] == reason


def test_a_cut_off_worker_row_fails_that_row_not_the_bench(tmp_path, monkeypatch):
    def cut_off(cmd, **kw):
        out = Path(cmd[cmd.index("--json-out") + 1])
        out.write_text('{"contender": "chronicals-full", "status": "o')
        return subprocess.CompletedProcess(cmd, 1, "", "OSError: [Errno 28] No space left on device\n")

    monkeypatch.setattr(cli.subprocess, "run", cut_off)
    runner = cli.Runner(timeout=10)
    row = runner.run("train", RunSpec(contender="chronicals-full", shape="tiny", device="cpu"))
    assert row["status"] == "crashed" and "unreadable" in row["reason"] and "No space left" in row["reason"]


def test_a_worker_dead_without_a_row_is_a_crashed_row(monkeypatch):
    """A worker that dies before writing its row (a segfault, killed for memory) gives a "crashed" row naming its
    exit status and last log line, not a generic error. Each worker has its own row file: with one file for all, a
    dead worker's row was the previous worker's ("ok"). A row read keeps the worker's output tail (stdout +
    stderr) for the results JSON."""
    calls = []
    monkeypatch.setattr(cli.subprocess, "run", fake_worker(calls, [{"contender": "chronicals-full", "status": "ok"},
                                                                   None]))
    runner = cli.Runner(timeout=10)
    first = runner.run("contender", RunSpec("chronicals-full", **TINY))
    row = runner.run("contender", RunSpec("chronicals-full", **TINY))
    assert first["status"] == "ok" and first["worker_log_tail"] == "out\nKilled\n"
    assert row["status"] == "crashed" and row["reason"] == "worker exited -9 without a row: ['Killed']"
    assert len({cmd[cmd.index("--json-out") + 1] for cmd, _ in calls}) == 2


def test_a_row_that_cannot_be_synced_leaves_no_file(tmp_path, monkeypatch):
    """The worker writes its row atomically: when the write fails (a full disk at the flush) the error propagates
    and no row file is left, so the host reads "crashed", never a cut-off or unsynced row."""
    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        worker.main(["--task", "contender", "--contender", "chronicals-full", "--seq", "1", "--json-out",
                     str(tmp_path / "row.json")])
    assert list(tmp_path.iterdir()) == []


def test_an_out_that_cannot_be_written_is_said_before_anything_runs(tmp_path, monkeypatch, capsys):
    """A read-only --out failed with a bare 'Operation not permitted' after every contender had run, the JSON lost
    (a bench walk). Exit 2 first, naming --out; nothing ran."""
    def run_plan(args, save=None):
        raise AssertionError(f"--out {args.out} passed the checks and would have run")
    monkeypatch.setattr(cli, "run_plan", run_plan)
    real_mkdir = Path.mkdir

    def read_only(self, *a, **k):
        if "ro" in self.parts:
            raise PermissionError(1, "Operation not permitted")
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert cli.main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "ro" / "x")]) == 2
    assert "--out " in capsys.readouterr().err
    # an existing directory where no file can be made (a read-only mount: os.access says yes to root): a file is
    # tried, not only the directory made
    assert cli.out_problem(str(tmp_path)) is None

    def refuse(*a, **k):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    assert cli.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 2
    assert (f"--out {tmp_path}: the result files cannot be written there (Read-only file system); give a directory "
            "you can write") in capsys.readouterr().err


def test_a_run_cut_short_keeps_the_tables_it_finished(tmp_path, monkeypatch):
    """The files were written only at the end: a stage cut by its time limit (run_gpu_e2e.sh's timeout 580) lost
    every finished row (a bench walk). Written after each table and check, marked partial until the end."""
    def inprocess(self, task, spec):
        if task == "learning":
            raise KeyboardInterrupt  # the run stops here
        return json.loads(json.dumps(run_task(task, spec), default=str))

    monkeypatch.setattr(cli.Runner, "run", inprocess)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["--device", "cpu", "--tiny", "--seq", "16", "--contenders", "chronicals-full", "--no-correctness",
                  "--out", str(tmp_path)])
    (js,) = tmp_path.glob("bench_e2e_cpu_*.json")
    res = json.loads(js.read_text())
    assert res["complete"] is False and res["tables"][0]["rows_data"][0]["status"] == "ok"
    assert "**Partial**" in js.with_suffix(".md").read_text()
    monkeypatch.setattr(cli.Runner, "run", lambda self, task, spec: json.loads(json.dumps(run_task(task, spec),
                                                                                          default=str)))
    cli.main(["--device", "cpu", "--tiny", "--seq", "16", "--contenders", "chronicals-full", "--no-correctness",
              "--no-learning", "--out", str(tmp_path / "whole")])
    (whole,) = (tmp_path / "whole").glob("bench_e2e_cpu_*.json")
    assert json.loads(whole.read_text())["complete"] is True and whole.with_suffix(".png").exists()
    assert len(list((tmp_path / "whole").iterdir())) == 3  # one set of files, written over as the run went


def test_rows_not_installed_or_out_of_memory_leave_exit_status_0(tmp_path, monkeypatch, capsys):
    """Exit 1 is for rows that trained wrong (FAILED): a contender not installed here or out of memory on this GPU is
    said in its row, and the run is still a good one."""
    rows = [{"contender": "hf-liger", "status": "not installed"}, {"contender": "hf-sdpa", "status": "OOM"},
            {"contender": "chronicals-full", "status": "ok"}]
    monkeypatch.setattr(cli, "run_plan", lambda args, save=None: {"tables": [{"shape": "tiny", "rows_data": rows}]})
    monkeypatch.setattr(cli, "write_report", lambda results, out, name, stem=None, chart=False:
                        {"json": tmp_path / "r.json"})
    assert cli.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    assert "FAILED" not in capsys.readouterr().err


def test_a_failed_row_is_exit_status_1(tmp_path, monkeypatch, capsys):
    """A FAILED row or check exited 0: a wrapper could not tell it from a good run (a bench walk)."""
    def failing(self, task, spec):
        row = json.loads(json.dumps(run_task(task, spec), default=str))
        if task == "contender":
            row.update(status="FAILED", reason="gradient norm not finite in 1 timed step")
        return row

    monkeypatch.setattr(cli.Runner, "run", failing)
    argv = ["--device", "cpu", "--tiny", "--seq", "16", "--contenders", "chronicals-full", "--no-correctness",
            "--no-learning", "--out", str(tmp_path)]
    assert cli.main(argv) == 1
    assert "FAILED: chronicals-full (tiny)" in capsys.readouterr().err and list(tmp_path.glob("*.json"))
    monkeypatch.setattr(cli, "run_plan", lambda args, save=None: {"tables": [], "learning": {"status": "FAILED"},
                                                                  "correctness": {"status": "ok"}})
    monkeypatch.setattr(cli, "write_report", lambda results, out, name, stem=None, chart=False:
                        {"json": tmp_path / "r.json"})
    assert cli.main(argv) == 1
    assert "FAILED: learning (exit status 1)" in capsys.readouterr().err
    monkeypatch.setattr(cli, "run_plan", lambda args, save=None: {"tables": [], "learning": {"status": "ok"},
                                                                  "correctness": {"status": "FAILED"}})
    assert cli.main(argv) == 1
    assert "FAILED: correctness (exit status 1)" in capsys.readouterr().err


def test_rows_as_packed_batch_starts_each_rows_positions_at_zero():
    """Every row is its own document, so each row's position ids run 0..S-1 (rope sees the same positions as the
    rows layout's dense attention), in both layouts."""
    from chronicals.bench.contenders import rows_as_packed_batch

    ids = torch.arange(12).reshape(3, 4)
    for layout in ("rows", "packed"):
        assert rows_as_packed_batch(ids, layout).position_ids.tolist() == [[0, 1, 2, 3]] * 3


def test_the_chronicals_model_is_built_in_bf16():
    """build_chronicals_model gives bf16 weights (the protocol's dtype for every contender), not fp32."""
    from chronicals.bench.contenders import build_chronicals_model

    model = build_chronicals_model(get_shape("tiny"), torch.device("cpu"), "torch", seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_the_full_contender_trains_every_parameter():
    """chronicals-full's optimizer and grad norm cover every weight, the embedding included."""
    built = tiny_build("chronicals-full")
    assert {id(p) for p in built.params} == {id(p) for p in built.model.parameters()}
    assert sum(len(g["params"]) for g in built.optimizer.param_groups) == len(list(built.model.parameters()))


def test_one_bench_step_runs_one_forward_of_its_batch():
    """forward_backward runs the model once per step (one micro-batch): the tokens/s of a row count B * (S - 1) loss
    tokens per step, so a step that ran the batch twice would time twice the work."""
    for step in ("trainer", "bench"):
        built = tiny_build("chronicals-full", step=step)
        calls = []
        built.model.register_forward_hook(lambda m, a, o: calls.append(1))
        built.forward_backward(built.prepare(torch.randint(0, 512, (2, 16))))
        assert len(calls) == 1, step


def test_the_bench_step_gives_the_trainer_steps_mean_loss():
    """--step bench calls the model itself; its loss is the same mean over the B * (S - 1) tokens as the trainer's
    step, not a sum."""
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in ("trainer", "bench"):
        built = tiny_build("chronicals-full", step=step)
        losses.append(built.forward_backward(built.prepare(ids)).float().item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-2) and abs(losses[0] - 6.24) < 0.3


@pytest.mark.parametrize("name, opts", [
    ("chronicals-full", dict(recompute=("norm", "swiglu"), fused_swiglu_recompute=True, gate_up_layers=0)),
    ("chronicals-full-keep", dict(recompute=())),
    ("chronicals-full-offer", dict(fused_swiglu_recompute=False)),
    ("chronicals-full-gateup", dict(recompute=("norm", "swiglu", "gate_up"), gate_up_layers=0)),
    ("chronicals-full-gateup2", dict(recompute=("norm", "swiglu", "gate_up"), gate_up_layers=2)),
])
def test_the_chronicals_contenders_set_the_model_options_their_labels_name(name, opts):
    """-keep saves every activation, -offer rebuilds the SwiGLU product by a second forward, -gateup[k] rebuilds the
    gate/up output (in the first k layers); the plain row keeps the model's defaults."""
    model = tiny_build(name).model
    assert {k: getattr(model.opts, k) for k in opts} == opts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the graphed rows capture on a CUDA device")
@pytest.mark.parametrize("name, in_place", [("chronicals-full-graphs", True), ("chronicals-full-graphs-fresh", False),
                                            ("chronicals-lora-graphs-fresh", False)])
def test_the_fresh_graph_rows_write_the_mlp_backward_into_new_buffers(name, in_place):
    """-fresh: the SwiGLU backward's gradients go to fresh buffers (``swiglu_backward_in_place=False``), not over
    the saved gate|up output; the plain graphed row keeps the in-place default."""
    assert tiny_build(name, device="cuda").model.opts.swiglu_backward_in_place is in_place


def test_the_chronicals_contenders_run_the_specs_attention_kernel():
    """RunSpec.attention (--attention) picks the packed rows' varlen kernel of the model."""
    assert tiny_build("chronicals-full", attention="flash").model.opts.attention == "flash"
    assert tiny_build("chronicals-full", attention="cudnn").model.opts.attention == "cudnn"


def test_the_gate_up_dial_keeps_the_method_of_its_name():
    assert get_contender("chronicals-full-gateup3").method == "full"
    assert get_contender("chronicals-lora-gateup3").method == "lora"


@pytest.mark.parametrize("name, grouped", [("chronicals-lora", True), ("chronicals-lora-nogroup", False)])
def test_the_nogroup_contender_injects_lora_without_groups(name, grouped):
    """-nogroup runs one LoRA call per projection; the plain LoRA row joins q/k/v (and gate/up) in one GEMM."""
    model = tiny_build(name).model
    has_group = [getattr(m, "lora_qkv", None) is not None for m in model.modules()]
    assert any(has_group) is grouped


def test_a_contender_whose_package_is_missing_is_a_not_installed_row(monkeypatch):
    """hf-peft needs peft: without it the row says "not installed: needs peft" instead of failing in its build."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "peft" else find_spec(m, *a))
    row = run_contender(RunSpec("hf-peft", **TINY))
    assert row["status"] == "not installed" and row["reason"] == "needs peft"


def test_the_hf_contenders_are_built_as_the_spec_says():
    """hf-sdpa and hf-peft: ids drawn over the whole vocabulary, checkpointing when the spec asks, PEFT's alpha from
    the spec, and torch.compile named where the row compiles."""
    assert tiny_build("hf-sdpa").vocab_size == get_shape("tiny").hf_config["vocab_size"]
    assert tiny_build("hf-sdpa", checkpointing=True).model.is_gradient_checkpointing
    assert not tiny_build("hf-sdpa").model.is_gradient_checkpointing
    assert tiny_build("hf-peft", lora_r=4, lora_alpha=24).model.peft_config["default"].lora_alpha == 24
    assert "torch.compile(model)" in tiny_build("hf-compile").notes


def test_the_hf_model_draws_the_same_weights_for_one_seed_whatever_ran_before():
    """build_hf_model seeds its init with RunSpec.seed, as the chronicals model does."""
    torch.manual_seed(1)
    a = tiny_build("hf-sdpa").model.state_dict()
    torch.manual_seed(2)
    b = tiny_build("hf-sdpa").model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
