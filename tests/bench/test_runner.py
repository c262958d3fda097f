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


def test_bench_without_a_gpu_says_how_to_run(monkeypatch, capsys):
    """No GPU and no --device/--tiny: a clear message at once, not rows of workers killed for memory; exit 2 (a
    SystemExit with the message gave 1, which means "diverged" to train's callers)."""
    monkeypatch.setattr(cli, "default_device", lambda: "cpu")
    assert cli.main(["--quick"]) == 2
    assert re.search(r"no CUDA GPU is visible .*chronicals bench --device cpu --tiny", capsys.readouterr().err)


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
    (["--tiny", "--shape", "0.5b"], "--tiny picks the tiny shape"),
    # each of these ran every contender first (or ran nonsense) and failed or wrote outside --out
    (["--device", "cpu", "--tiny", "--contenders", ""],
     "--contenders '': give comma-separated contender names, none empty"),
    (["--device", "cpu", "--tiny", "--contenders", "chronicals-full,chronicals-full"],
     "--contenders 'chronicals-full,chronicals-full': a contender is named twice"),
    (["--device", "cpu", "--tiny", "--attention", "cudnn"], "--attention cudnn chooses the packed rows' kernel"),
    (["--device", "cpu", "--tiny", "--learning-lr", "nan"], "--learning-lr nan: must be a finite number > 0"),
    (["--device", "cpu", "--tiny", "--graphs"], "--graphs adds CUDA-graph rows, which need a GPU"),
    (["--device", "tpu", "--tiny"], "--device tpu: use cpu, cuda or cuda:N"),
    (["--device", "cpu", "--tiny", "--name", "a/b"], "--name 'a/b': a file stem, without '/'"),
    (["--device", "cpu", "--tiny", "--name", ".."], "--name '..': a file stem"),
    (["--device", "cpu", "--tiny", "--out", __file__], f"--out {__file__}: {__file__} is a file, not a directory"),
])
def test_bad_arguments_are_said_before_anything_runs(argv, says, capsys):
    """Exit 2 with the argument named, before the no-GPU check or any worker (an unknown contender came after the
    no-GPU message on a CPU machine, and as a bad-input error, exit 3, with --device cpu)."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"chronicals bench: error: {says}" in err and "no CUDA GPU" not in err


def test_an_out_of_memory_error_is_an_oom_row():
    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    except torch.OutOfMemoryError as e:
        row = worker._error_row({"contender": "x"}, e)
    assert row["status"] == "OOM" and "out of memory" in row["reason"]


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
