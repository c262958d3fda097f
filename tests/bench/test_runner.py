"""The contender runner on the tiny model on CPU: the same code paths as the GPU bench; an out-of-memory error
is an OOM row; a worker's cut-off JSON row (a full disk while the worker wrote it) is that
row "crashed" with the reason, not the whole bench ended by a bare JSON error."""

import json

import re
from pathlib import Path

import pytest
import torch

from chronicals.bench import cli, worker
from chronicals.bench.protocol import RunSpec
from chronicals.bench.worker import run_contender, run_task

TINY = dict(shape="tiny", rows=2, seq=16, warmup=1, steps=2, device="cpu")


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
    (["--tiny", "--shape", "0.5b"], "--tiny picks the tiny shape"),
    # each of these ran every contender first (or ran nonsense) and failed or wrote outside --out
    (["--device", "cpu", "--tiny", "--contenders", ""],
     "--contenders '': give comma-separated contender names, none empty"),
    (["--device", "cpu", "--tiny", "--contenders", "chronicals-full,chronicals-full"],
     "--contenders 'chronicals-full,chronicals-full': a contender is named twice"),
    (["--device", "cpu", "--tiny", "--attention", "cudnn"], "--attention cudnn chooses the packed rows' kernel"),
    (["--device", "cpu", "--tiny", "--learning-lr", "nan"], "--learning-lr nan: must be a finite number > 0"),
    (["--device", "cpu", "--tiny", "--learning-lr", "0"], "--learning-lr 0.0: must be a finite number > 0"),
    (["--device", "cpu", "--tiny", "--graphs"], "--graphs adds CUDA-graph rows, which need a GPU"),
    (["--tiny", "--graphs"], "--graphs adds CUDA-graph rows, which need a GPU"),  # the default device: cpu here
    (["--shape", "tiny", "--graphs"], "--graphs adds CUDA-graph rows, which need a GPU"),
    (["--device", "tpu", "--tiny"], "--device tpu: use cpu, cuda or cuda:N"),
    (["--device", "cuda:x", "--tiny"], "--device cuda:x: use cpu, cuda or cuda:N"),
    (["--device", "cuda", "--tiny"], "--device cuda: no CUDA GPU is visible here; use --device cpu with --tiny"),
    (["--device", "cuda:0", "--tiny"], "--device cuda:0: no CUDA GPU is visible here"),
    (["--device", "cpu", "--tiny", "--name", "a/b"], "--name 'a/b': a file stem, without '/'"),
    (["--device", "cpu", "--tiny", "--name", ".."], "--name '..': a file stem"),
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
])
def test_good_arguments_pass_the_checks(argv, gpu, tmp_path, monkeypatch):
    """The checks above refuse only what is wrong: the least allowed values, --attention with --layout packed (the
    packed rows' kernel), --graphs and --device cuda[:N] where a GPU is visible all pass."""
    monkeypatch.setattr(cli, "default_device", lambda: "cuda" if gpu else "cpu")
    assert cli.check_args(cli.parse_args([*argv, "--out", str(tmp_path)])) is None


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


def test_a_cut_off_worker_row_fails_that_row_not_the_bench(tmp_path, monkeypatch):
    import subprocess

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
    exit status and last log line, not a generic error."""
    import subprocess

    monkeypatch.setattr(cli.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, -9, "", "Killed\n"))
    row = cli.Runner(timeout=10).run("contender", RunSpec("chronicals-full", shape="tiny", device="cpu"))
    assert row["status"] == "crashed" and row["reason"] == "worker exited -9 without a row: ['Killed']"


def test_an_out_that_cannot_be_written_is_said_before_anything_runs(tmp_path, monkeypatch, capsys):
    """A read-only --out failed with a bare 'Operation not permitted' after every contender had run, the JSON lost
    (a bench walk). Exit 2 first, naming --out; nothing ran."""
    ran = []
    monkeypatch.setattr(cli, "run_plan", lambda args: ran.append(args))
    real_mkdir = Path.mkdir

    def read_only(self, *a, **k):
        if "ro" in self.parts:
            raise PermissionError(1, "Operation not permitted")
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert cli.main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "ro" / "x")]) == 2
    assert "--out " in capsys.readouterr().err and not ran


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


def test_a_failed_row_is_exit_status_1(tmp_path, monkeypatch, capsys):
    """A FAILED row or check exited 0: a wrapper could not tell it from a good run (a bench walk)."""
    def failing(self, task, spec):
        row = json.loads(json.dumps(run_task(task, spec), default=str))
        if task == "contender":
            row.update(status="FAILED", reason="gradient norm not finite in 1 timed steps")
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
