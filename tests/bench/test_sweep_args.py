"""--model-sweep honours --tiny and --shape: the plan and the tables run_plan builds from it, an OOM row retried
with checkpointing (no model is built: the contender runs are recorded, not started)."""

import pytest
import torch

from chronicals.bench import cli
from chronicals.bench.contenders import get_contender
from chronicals.bench.protocol import RunSpec
from chronicals.bench.shapes import get_shape
from test_runner import plan_calls


@pytest.mark.parametrize("argv,plan", [
    ([], [("0.5b", 4, 2048), ("1.5b", 4, 2048), ("3b", 4, 2048), ("8b", 4, 2048)]),
    (["--tiny"], [("tiny", 2, 32)]),
    (["--shape", "tiny"], [("tiny", 2, 32)]),
    (["--shape", "3b"], [("3b", 4, 2048)]),
    (["--tiny", "--rows", "3", "--seq", "16"], [("tiny", 3, 16)]),
    (["--shape", "1.5b", "--seq", "1024"], [("1.5b", 4, 1024)]),
])
def test_model_sweep_plan(argv, plan):
    assert cli.model_sweep_plan(cli.parse_args(["--model-sweep", *argv])) == plan


@pytest.mark.parametrize("argv,tables", [
    (["--tiny"], [("tiny", 2, 32)]),
    (["--shape", "8b"], [("8b", 4, 2048)]),
])
def test_run_plan_sweeps_only_the_chosen_shape(monkeypatch, argv, tables):
    ran = []

    def record(runner, names, spec, peak):
        ran.append((spec.shape, spec.rows, spec.seq, tuple(names)))
        return []

    monkeypatch.setattr(cli, "contender_rows", record)
    res = cli.run_plan(cli.parse_args(["--device", "cpu", "--model-sweep", *argv]))
    assert ran == [(*t, cli.LORA_SWEEP) for t in tables]
    assert [(t["shape"], t["rows"], t["seq"]) for t in res["tables"]] == tables


@pytest.mark.parametrize("argv,tables", [
    # the rows are tokens // seq (2 x 32 = 64 tokens per step), not --rows
    (["--rows", "2", "--seq", "32"], [(8, 8), (4, 16), (2, 32)]),
    # the seq of all the step's tokens in one row is in the sweep
    (["--rows", "1", "--seq", "32"], [(4, 8), (2, 16), (1, 32)]),
])
def test_seq_sweep_keeps_the_tokens_per_step(monkeypatch, argv, tables):
    """--seq-sweep keeps --rows x --seq tokens per step at every seq, up to the seq that takes them all in one row."""
    _, ran = plan_calls(monkeypatch, ["--device", "cpu", "--tiny", "--seq-sweep", *argv])
    assert [(spec.rows, spec.seq) for _, spec in ran] == tables


@pytest.mark.parametrize("argv", [["--tiny"], ["--shape", "tiny"]])
def test_shape_tiny_is_tiny(monkeypatch, argv):
    """--shape tiny runs as --tiny does: 1 + 2 steps, not the protocol's 4 + 12 (a CPU run of minutes)."""
    tasks, tables = plan_calls(monkeypatch, ["--device", "cpu", "--no-correctness", "--no-learning", *argv])
    specs = [spec for _, spec in tasks + tables]
    assert specs and all((s.warmup, s.steps) == (1, 2) for s in specs)


@pytest.mark.parametrize("first,flags,runs,rows", [
    ("OOM", [], [("chronicals-lora", False), ("chronicals-lora", True)], [("OOM", False), ("ok", True)]),
    ("OOM", ["--checkpointing"], [("chronicals-lora", True)], [("OOM", True)]),
    ("error", [], [("chronicals-lora", False)], [("error", False)]),  # checkpointing cannot mend it
])
def test_model_sweep_retries_an_oom_row_with_checkpointing(monkeypatch, first, flags, runs, rows):
    """An OOM row is retried once with checkpointing, only when it ran without: under --checkpointing the OOM row
    already had it, and a retry ran the same thing again. A row that failed otherwise is not retried."""
    ran = []

    def fake_run(self, task, spec):
        ran.append((spec.contender, spec.checkpointing))
        if len(ran) == 1:
            return {"contender": spec.contender, "status": first, "reason": "it failed"}
        return {"contender": spec.contender, "status": None, "grad_norms": [1.0], "losses": [2.0, 1.0],
                "tokens_per_s": 10.0}

    monkeypatch.setattr(cli.Runner, "run", fake_run)
    res = cli.run_plan(cli.parse_args(["--device", "cpu", "--tiny", "--model-sweep", *flags, "--contenders",
                                       "chronicals-lora"]))
    assert ran == runs
    assert [(r["status"], r["checkpointing"]) for r in res["tables"][0]["rows_data"]] == rows


@pytest.mark.parametrize("name", ["chronicals-full", "chronicals-lora"])
@pytest.mark.parametrize("on", [True, False])
def test_the_chronicals_contenders_build_with_the_specs_checkpointing(name, on):
    """The chronicals contenders build their model with RunSpec.checkpointing, which --checkpointing, the OOM
    retry above and --max-context set: ignored, they all ran silently without checkpointing."""
    spec = RunSpec(name, shape="tiny", rows=2, seq=16, device="cpu", checkpointing=on)
    built = get_contender(name).build(spec, get_shape("tiny"), torch.device("cpu"))
    assert built.model.opts.checkpointing is on
