"""Table formatting, MFU, and the result files (JSON + markdown + PNG, FAILED bars hatched)."""

import datetime
import json
import math
import subprocess
from pathlib import Path

import pytest

from chronicals.bench import report
from chronicals.bench.report import (correctness_markdown, finish_row, learning_markdown, markdown_table,
                                     report_markdown, table_cells, table_markdown, write_report)


def _ok_row(**kw):
    row = {"contender": "chronicals-full", "label": "chronicals", "method": "full", "status": "ok", "reason": "",
           "tokens_per_s": 150000.0, "flops_per_token": 3.1e9, "peak_gib": 12.345, "min_grad_norm": 0.123456,
           "losses": [11.93, 11.9], "grad_norms": [0.2, 0.123456]}
    row.update(kw)
    return row


def test_mfu_and_limit():
    row = finish_row(_ok_row(), peak_tflops=775.0)
    assert abs(row["mfu"] - 150000 * 3.1e9 / 775e12) < 1e-12
    assert abs(row["limit_tokens_per_s"] - 775e12 / 3.1e9) < 1e-6
    assert "mfu" not in finish_row(_ok_row(), peak_tflops=None)  # CPU: no peak, no MFU


def test_table_cells_format():
    c = table_cells(finish_row(_ok_row(), 775.0))
    assert c["tokens/s"] == "150,000" and c["MFU"] == "60.0%" and c["peak GiB"] == "12.3"
    assert c["min grad norm"] == "0.123" and c["loss first -> last"] == "11.930 -> 11.900" and c["status"] == "ok"
    failed = table_cells(_ok_row(status="FAILED", reason="gradient norm 0 | x"))
    assert failed["status"] == "FAILED: gradient norm 0 / x"  # no stray column separator
    missing = table_cells({"contender": "hf-liger", "label": "transformers + Liger", "status": "not installed",
                           "reason": "needs liger_kernel"})
    assert missing["tokens/s"] == "" and missing["status"] == "not installed: needs liger_kernel"
    assert table_cells(_ok_row(checkpointing=True))["contender"] == "chronicals (ckpt)"  # slower by design
    assert table_cells(_ok_row(losses=[6.2, 6.0, 5.5, 5.1]))["loss first -> last"] == "6.200 -> 5.100"  # not the 2nd


def test_mfu_and_peak_cells_say_na_only_for_measured_rows():
    """A measured row without MFU or peak (CPU: no matmul peak, no allocator peak) says "n/a"; a row that measured
    nothing (OOM: tokens_per_s None) is blank, and finish_row gives it the limit without an MFU: it computed one
    from None and crashed the report (bench.cli calls it on every row)."""
    cpu = table_cells(finish_row(_ok_row(peak_gib=None), None))
    assert cpu["MFU"] == "n/a" and cpu["peak GiB"] == "n/a" and cpu["tokens/s"] == "150,000"
    oom = finish_row({"contender": "hf-sdpa", "label": "transformers", "method": "full", "status": "OOM",
                      "reason": "out of memory", "flops_per_token": 3.1e9, "tokens_per_s": None}, 775.0)
    assert "mfu" not in oom and abs(oom["limit_tokens_per_s"] - 775e12 / 3.1e9) < 1e-6
    cells = table_cells(oom)
    assert cells["MFU"] == "" and cells["peak GiB"] == "" and cells["tokens/s"] == ""
    assert cells["min grad norm"] == "" and cells["loss first -> last"] == ""


def test_a_row_without_a_flop_count_gets_no_limit_or_mfu_at_a_measured_peak():
    """A row that never reached the worker's FLOP count (not installed, a crashed worker) is finished with the run's
    peak like every other row: no limit, no MFU, and no division by a missing count."""
    missing = finish_row({"contender": "hf-liger", "status": "not installed", "reason": "needs liger_kernel"}, 775.0)
    assert "limit_tokens_per_s" not in missing and "mfu" not in missing
    zero = finish_row(_ok_row(flops_per_token=0), 775.0)
    assert "limit_tokens_per_s" not in zero and "mfu" not in zero


def test_a_single_step_row_shows_its_one_loss_as_first_and_last():
    """--warmup 0 --steps 1 records one loss: the cell shows it at both ends."""
    assert table_cells(_ok_row(losses=[6.25]))["loss first -> last"] == "6.250 -> 6.250"


def test_markdown_table_shape():
    md = markdown_table([_ok_row(), _ok_row(contender="hf-sdpa", label="transformers, SDPA")])
    lines = md.strip().splitlines()
    assert len(lines) == 4 and all(line.count("|") == 9 for line in lines)


def test_write_report(tmp_path):
    results = {"environment": {"gpu": "NVIDIA H200", "date": "2026-11-30T10:00:00+00:00", "git_sha": "abc1234",
                               "versions": {"torch": "2.11.0"}},
               "peak_tflops": 775.0, "plan": {"warmup": 4, "steps": 12, "note": ""},
               "tables": [{"title": "0.5B", "rows_data": [finish_row(_ok_row(), 775.0),
                                                          finish_row(_ok_row(status="FAILED", reason="r"), 775.0)]}],
               "correctness": {"shape": "0.5b", "rows": 4, "seq": 1024, "status": "error", "reason": "boom",
                               "parity": []}}
    paths = write_report(results, tmp_path)
    assert paths["json"].name == "bench_e2e_NVIDIA-H200_2026-11-30.json"
    assert json.loads(paths["json"].read_text())["tables"][0]["rows_data"][0]["status"] == "ok"
    md = paths["md"].read_text()
    assert "775 TFLOP/s" in md and "git abc1234" in md and "| chronicals | full | 150,000 | 60.0% |" in md
    assert "error: boom" in md
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_write_report_keeps_a_dotted_shape_name(tmp_path):
    """A run named after the 0.5b shape must not lose '.5b_<gpu>_<date>' to Path.with_suffix."""
    results = {"environment": {"gpu": "NVIDIA H200", "date": "2026-11-30T10:00:00+00:00", "git_sha": "abc1234",
                               "versions": {}},
               "peak_tflops": 775.0, "plan": {"warmup": 4, "steps": 12, "note": ""},
               "tables": [{"title": "0.5B", "rows_data": [finish_row(_ok_row(), 775.0)]}]}
    paths = write_report(results, tmp_path, name="bench_e2e_0.5b")
    assert paths["json"].name == "bench_e2e_0.5b_NVIDIA-H200_2026-11-30.json"
    assert paths["md"].name == "bench_e2e_0.5b_NVIDIA-H200_2026-11-30.md"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths.values())


def test_table_heading_states_the_limit_at_the_measured_peak():
    """Each method's heading line gives its FLOP per token, its basis (LoRA: 4 x matmul params, not full's 6 x) and,
    when a peak was measured, its limit in tokens/s at that peak (100% MFU); a table without a peak (CPU) gets no
    limit clause."""
    md = table_markdown({"title": "t", "rows_data": [finish_row(_ok_row(), 775.0),
                                                     finish_row(_ok_row(method="lora", flops_per_token=2.1e9), 775.0)]},
                        775.0)
    assert ("- full: 3.1 GFLOP per token (6 x matmul params + attention), limit 250,000 tokens/s at the measured "
            "peak") in md
    assert ("- lora: 2.1 GFLOP per token (4 x matmul params + attention: frozen weights have no weight-gradient GEMM)"
            ", limit 369,048 tokens/s at the measured peak") in md
    cpu = table_markdown({"title": "t", "rows_data": [finish_row(_ok_row(), None)]}, None)
    assert "- full: 3.1 GFLOP per token" in cpu and "limit" not in cpu


def test_a_graphed_row_says_what_its_peak_counts():
    """The note comes with a table holding one CUDA-graph row among plain ones, not only with a table of graph rows."""
    plain = table_markdown({"title": "t", "rows_data": [finish_row(_ok_row(), 775.0)]}, 775.0)
    graphed = table_markdown({"title": "t", "rows_data": [finish_row(_ok_row(graph_pool_gib=11.4), 775.0)]}, 775.0)
    assert "graph's memory pool" not in plain and "graph's memory pool plus all the pool reserves" in graphed
    mixed = table_markdown({"title": "t", "rows_data": [finish_row(_ok_row(), 775.0),
                                                       finish_row(_ok_row(graph_pool_gib=11.4), 775.0)]}, 775.0)
    assert "graph's memory pool plus all the pool reserves" in mixed


def test_a_table_opens_with_its_title():
    md = table_markdown({"title": "Qwen2.5-0.5B architecture, 16 x 1024 tokens per step",
                         "rows_data": [finish_row(_ok_row(), 775.0)]}, 775.0)
    assert md.startswith("### Qwen2.5-0.5B architecture, 16 x 1024 tokens per step\n")


def test_the_report_names_the_versions_and_says_when_no_peak_was_measured():
    """The heading's versions line lists every package with its version; a run without a matmul peak (CPU) says MFU
    was not computed instead of a peak line."""
    res = _small_results()
    res["environment"]["versions"] = {"python": "3.12.1", "torch": "2.11.0"}
    md = report_markdown(res)
    assert "Versions: python 3.12.1, torch 2.11.0." in md
    assert "bf16 matmul peak measured in this run: 775 TFLOP/s." in md
    cpu = report_markdown(dict(res, peak_tflops=None))
    assert "No GPU: MFU not computed (no matmul peak on this device)." in cpu and "TFLOP/s" not in cpu


def _small_results(date="2026-11-30T10:00:00+00:00", sha="abc1234"):
    return {"environment": {"gpu": "NVIDIA H200", "date": date, "git_sha": sha, "versions": {}},
            "peak_tflops": 775.0, "plan": {"warmup": 4, "steps": 12, "note": ""},
            "tables": [{"title": "0.5B", "rows_data": [finish_row(_ok_row(), 775.0)]}]}


def test_report_states_the_plan_its_note_and_its_checks():
    """The protocol line gives the plan's warm-up and timed step counts in that order (3 warm-up + 7 timed here);
    the plan's note (--quick's skips, a sweep's left-out checks) and the learning check's table are in the
    markdown. Swapped counts, or a dropped note or learning section, passed."""
    res = _small_results()
    res["plan"] = {"warmup": 3, "steps": 7, "note": "--quick: 2 warm-up + 6 timed steps, contenders a, b"}
    res["learning"] = {"rows": 2, "seq": 32, "steps": 5, "shape": "tiny", "status": "ok",
                       "runs": [{"method": "full", "losses": [6.0, 3.0], "min_grad_norm": 0.5, "status": "ok",
                                 "reason": ""}]}
    md = report_markdown(res)
    assert "3 warm-up + 7 timed steps between synchronizations" in md
    assert "\n--quick: 2 warm-up + 6 timed steps, contenders a, b\n" in md
    assert "### Learning check: chronicals on a periodic sequence (2 x 32, 5 steps, tiny shape)" in md
    assert "| full | 6.000 -> 3.000 | 0.5 | ok |" in md


def test_max_context_rows_say_none_the_failure_or_the_cap():
    """The longest-context table: a contender that trained up to the cap says '<cap> is the cap' (the cell was
    blank); one that failed says its first failure; one that trained nothing says 'none'."""
    res = _small_results()
    res["max_context"] = [
        {"shape": "tiny", "contender": "a", "max_ok": 256, "first_failure": "", "cap": 256, "peak_gib": 0.5,
         "tokens_per_s": 1234.0},
        {"shape": "tiny", "contender": "b", "max_ok": 128, "first_failure": "seq 256: OOM out of memory", "cap": 256,
         "peak_gib": 0.25, "tokens_per_s": 99.0},
        {"shape": "tiny", "contender": "c", "max_ok": None, "first_failure": "seq 64: error boom", "cap": 256,
         "peak_gib": None, "tokens_per_s": None}]
    md = report_markdown(res)
    assert "| tiny | a | 256 | 0.5 | 1,234 | 256 is the cap |" in md
    assert "| tiny | b | 128 | 0.2 | 99 | seq 256: OOM out of memory |" in md
    assert "| tiny | c | none | n/a | n/a | seq 64: error boom |" in md


def test_correctness_row_puts_each_number_in_its_column():
    """The parity table's columns in order: fp32 reference, transformers bf16, chronicals for the loss and for the
    grad norm, then the cosine 'transformers / chronicals'. Every value distinct, so a swap shows (no test had a
    parity row with numbers)."""
    p = {"method": "full", "loss_ref": 1.0, "loss_hf": 2.0, "loss_ours": 3.0, "grad_norm_ref": 4.0,
         "grad_norm_hf": 5.0, "grad_norm_ours": 6.0, "grad_cos_hf": 0.9, "grad_cos_ours": 0.8, "status": "ok",
         "reason": ""}
    md = correctness_markdown({"rows": 4, "seq": 1024, "shape": "0.5b", "status": "ok", "parity": [p]})
    assert "| full | 1.0000 | 2.0000 | 3.0000 | 4 | 5 | 6 | 0.90000 / 0.80000 | ok |" in md


def test_a_parity_row_without_numbers_still_says_its_method_and_status():
    """A method whose parity did not run (peft not installed, an error) keeps its row with blank numbers and its
    status; a FAILED check's reasons are in its rows, so nothing repeats them under the table."""
    res = {"rows": 4, "seq": 1024, "shape": "0.5b", "status": "FAILED", "reason": "lora: RuntimeError: boom",
           "parity": [{"method": "full", "status": "not installed", "reason": "needs peft"},
                      {"method": "lora", "status": "error", "reason": "RuntimeError: boom"}]}
    md = correctness_markdown(res)
    assert "| full | | | | | | | | not installed: needs peft |" in md
    assert md.endswith("| lora | | | | | | | | error: RuntimeError: boom |\n")


def test_learning_table_rows_and_a_check_level_error():
    """A run's row: first -> LAST loss (of 4, not the second), its min grad norm, and its status with the reason; a
    check that ended in an error (no runs judged) says so under the table. learning_markdown was untested."""
    res = {"rows": 8, "seq": 512, "steps": 40, "shape": "0.5b", "status": "FAILED",
           "runs": [{"method": "full", "losses": [6.0, 5.0, 4.0, 3.0], "min_grad_norm": 0.25, "status": "ok",
                     "reason": ""},
                    {"method": "lora", "losses": [6.0, 5.9], "min_grad_norm": 0.5, "status": "FAILED",
                     "reason": "loss did not fall by 15% of its first value"}]}
    md = learning_markdown(res)
    assert "(8 x 512, 40 steps, 0.5b shape)" in md
    assert "| full | 6.000 -> 3.000 | 0.25 | ok |" in md
    assert "| lora | 6.000 -> 5.900 | 0.5 | FAILED: loss did not fall by 15% of its first value |" in md
    err = learning_markdown({"rows": 8, "seq": 512, "steps": 40, "shape": "0.5b", "status": "timeout",
                             "reason": "worker timed out after 600 s", "runs": []})
    assert err.rstrip().endswith("timeout: worker timed out after 600 s")


def test_a_second_run_of_one_plan_on_one_day_keeps_the_first(tmp_path):
    """Same name, GPU and date: the second run's files get _2 (then _3), the first run's stay as written."""
    first = write_report(_small_results(sha="aaaaaaa"), tmp_path, name="bench_e2e_0.5b")
    second = write_report(_small_results(sha="bbbbbbb"), tmp_path, name="bench_e2e_0.5b")
    third = write_report(_small_results(sha="ccccccc"), tmp_path, name="bench_e2e_0.5b")
    assert second["json"].name == "bench_e2e_0.5b_NVIDIA-H200_2026-11-30_2.json"
    assert third["md"].name == "bench_e2e_0.5b_NVIDIA-H200_2026-11-30_3.md"
    for paths, sha in ((first, "aaaaaaa"), (second, "bbbbbbb"), (third, "ccccccc")):
        assert json.loads(paths["json"].read_text())["environment"]["git_sha"] == sha
        assert f"git {sha}" in paths["md"].read_text()
    assert len(list(tmp_path.iterdir())) == 9  # three runs x json, md, png; no temporary file left
    other_day = write_report(_small_results(date="2026-12-01T10:00:00+00:00"), tmp_path, name="bench_e2e_0.5b")
    assert other_day["json"].name == "bench_e2e_0.5b_NVIDIA-H200_2026-12-01.json"


def test_an_earlier_md_or_png_alone_holds_the_name(tmp_path):
    """An earlier run that left only its .md (or a _2 .png) under the name, its .json gone, still holds the name:
    the new run goes on to _3 and does not write over those files."""
    (tmp_path / "b_NVIDIA-H200_2026-11-30.md").write_text("first run")
    (tmp_path / "b_NVIDIA-H200_2026-11-30_2.png").write_bytes(b"\x89PNG")
    stem = report.output_stem(_small_results(), tmp_path, name="b")
    assert stem.name == "b_NVIDIA-H200_2026-11-30_3"
    assert (tmp_path / "b_NVIDIA-H200_2026-11-30.md").read_text() == "first run"


def test_a_name_with_glob_characters_still_sees_the_earlier_files(tmp_path):
    """--name may hold '[' (a file stem, not a pattern): the earlier run's .md under that name still holds it."""
    (tmp_path / "run[1]_NVIDIA-H200_2026-11-30.md").write_text("first run")
    stem = report.output_stem(_small_results(), tmp_path, name="run[1]")
    assert stem.name == "run[1]_NVIDIA-H200_2026-11-30_2"


def test_a_given_stem_is_written_over_and_chart_false_writes_no_png(tmp_path):
    """bench.cli saves after each table: chart=False writes JSON and markdown only (it wrote the PNG too), and
    stem= writes over that run's files (no _2)."""
    first = write_report(_small_results(sha="aaaaaaa"), tmp_path, name="b", chart=False)
    assert set(first) == {"json", "md"} and not list(tmp_path.glob("*.png"))
    stem = first["json"].with_name(first["json"].name[:-len(".json")])
    again = write_report(_small_results(sha="bbbbbbb"), tmp_path, name="b", stem=stem)
    assert again["json"] == first["json"] and again["md"] == first["md"] and again["png"].exists()
    assert '"bbbbbbb"' in first["json"].read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in again.values())


def test_a_run_with_no_measured_row_writes_no_chart(tmp_path):
    """Only checks, or every row OOM: JSON and markdown, no chart; plot_png crashed in plt.subplots(0, 1)."""
    results = {"environment": {"gpu": "cpu", "date": "2026-11-30T10:00:00+00:00", "git_sha": "abc1234",
                               "versions": {}}, "peak_tflops": None, "plan": {"warmup": 1, "steps": 2, "note": ""},
               "tables": [{"title": "tiny", "rows_data": [{"contender": "hf-sdpa", "status": "OOM",
                                                           "reason": "out of memory"}]}]}
    paths = write_report(results, tmp_path)
    assert set(paths) == {"json", "md"} and sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".md"]


def test_partial_only_when_complete_is_false():
    """**Partial** only for complete: False; results without the key (a caller other than bench.cli) or with
    complete: True are not called partial."""
    assert "**Partial**" not in report_markdown(_small_results())
    assert "**Partial**" not in report_markdown(dict(_small_results(), complete=True))
    assert "**Partial**" in report_markdown(dict(_small_results(), complete=False))


def test_a_failed_chart_leaves_no_file_behind(tmp_path, monkeypatch):
    import matplotlib.figure

    def boom(self, fname, *a, **k):  # half a file written, then the disk fills up
        if hasattr(fname, "write"):
            fname.write(b"\x89PNG half")
        else:
            Path(fname).write_bytes(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", boom)
    with pytest.raises(OSError, match="disk full"):
        write_report(_small_results(), tmp_path, name="x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x_NVIDIA-H200_2026-11-30.json",
                                                         "x_NVIDIA-H200_2026-11-30.md"]


def test_chart_hatches_failed_rows_red(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig: figs.append(fig))
    row = {"contender": "chronicals-full", "label": "chronicals", "method": "full", "tokens_per_s": 100.0}
    results = {"environment": {"gpu": "g", "date": "2026-01-01T00:00:00+00:00", "git_sha": "s"},
               "tables": [{"title": "t", "rows_data": [dict(row, status="ok"),
                                                      dict(row, contender="hf-sdpa", status="FAILED"),
                                                      # timed, then an error (reading its memory peak)
                                                      dict(row, contender="hf-peft", status="error")]}]}
    report.plot_png(results, tmp_path / "x.png")
    bars = figs[0].axes[0].patches
    assert [b.get_hatch() for b in bars] == [None, "//", "//"]


def test_chart_draws_each_methods_limit(tmp_path, monkeypatch):
    """The full and LoRA limits (tokens/s at the measured peak) are dashed and dotted lines in the legend."""
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig: figs.append(fig))
    rows = [finish_row(_ok_row(), 775.0), finish_row(_ok_row(method="lora", flops_per_token=2.1e9), 775.0)]
    results = {"environment": {"gpu": "g", "date": "2026-01-01T00:00:00+00:00", "git_sha": "s"},
               "tables": [{"title": "t", "rows_data": rows}]}
    report.plot_png(results, tmp_path / "x.png")
    ax = figs[0].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["full limit 250,000", "lora limit 369,048"]
    assert [ln.get_linestyle() for ln in ax.get_lines()] == ["--", ":"]


def test_a_failed_rows_json_is_strict_json_and_its_cell_says_nan(tmp_path):
    """A FAILED row's NaN grad norm was written as a bare NaN (strict parsers refuse the file) and shown as a blank
    cell (a bench walk): "nan" in both."""
    row = finish_row(_ok_row(status="FAILED", reason="gradient norm not finite in 1 timed step"), 775.0)
    row["min_grad_norm"], row["grad_norms"] = float("nan"), [1.0, float("inf")]
    results = {"environment": {"gpu": "cpu", "date": "2026-11-30T10:00:00+00:00", "git_sha": "abc1234",
                               "versions": {}}, "peak_tflops": None, "plan": {"warmup": 1, "steps": 2, "note": ""},
               "tables": [{"title": "tiny", "rows_data": [row]}]}
    paths = write_report(results, tmp_path)
    text = paths["json"].read_text()
    saved = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))
    assert saved["tables"][0]["rows_data"][0]["min_grad_norm"] == "nan"
    assert saved["tables"][0]["rows_data"][0]["grad_norms"] == [1.0, "inf"]
    assert "| nan |" in paths["md"].read_text()
    assert report.finite_json({"t": (1.0, math.nan, (math.inf,))}) == {"t": [1.0, "nan", ["inf"]]}  # tuples too


def test_environment_date_is_utc_and_versions_go_past_a_missing_package(monkeypatch):
    """The date in the result file names and headings is UTC (an ISO time with +00:00), so machines in other time
    zones name one moment's run alike (a local naive time had no offset); a package that is not installed (unsloth
    on most machines) is left out of the versions and the packages after it are still read (not the list's end)."""
    monkeypatch.setenv("CHRONICALS_GIT_SHA", "abc1234")
    monkeypatch.setattr(report, "PACKAGES", ("no-such-package-installed", "torch"))
    env = report.environment("cpu")
    when = datetime.datetime.fromisoformat(env["date"])
    assert env["date"].endswith("+00:00") and when.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()) < 60
    assert env["gpu"] == "cpu" and env["git_sha"] == "abc1234"
    assert set(env["versions"]) == {"python", "torch"} and env["versions"]["torch"]


def test_out_with_a_tilde_is_the_home_directory(tmp_path, monkeypatch):
    """--out=~/x (not expanded by the shell): mkdir made ./~/x, the write went to $HOME/x, and every result was
    lost after the run (a bench walk)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    results = {"environment": {"gpu": "cpu", "date": "2026-11-30T10:00:00+00:00", "git_sha": "abc1234",
                               "versions": {}}, "peak_tflops": None, "plan": {"warmup": 1, "steps": 2, "note": ""},
               "tables": [{"title": "tiny", "rows_data": [finish_row(_ok_row(), None)]}]}
    paths = write_report(results, "~/res")
    assert paths["json"].parent == tmp_path / "home" / "res" and not (tmp_path / "~").exists()


_GIT = ["git", "-c", "user.email=a@b", "-c", "user.name=n"]


def _committed_repo(root: Path) -> str:
    """``git init`` at ``root`` and one commit of everything under it: HEAD's short sha."""
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run([*_GIT, "-C", str(root), "add", "-A"], check=True)
    subprocess.run([*_GIT, "-C", str(root), "commit", "-qm", "x"], check=True)
    return subprocess.check_output(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], text=True).strip()


def test_git_sha_says_dirty_and_another_projects_checkout_is_not_ours(tmp_path, monkeypatch):
    """A dirty tree was stamped with the clean HEAD sha; a copy installed inside another git project got that
    project's sha (a bench walk). Dirty trees say so; a copy outside chronicals' own checkout gives its version."""
    import os
    import shutil
    import sys

    monkeypatch.delenv("CHRONICALS_GIT_SHA", raising=False)
    repo = tmp_path / "proj"
    shutil.copytree(Path(report.__file__).parent.parent, repo / "src" / "chronicals")
    sha = _committed_repo(repo)
    probe = [sys.executable, "-c", "from chronicals.bench.report import git_sha; print(git_sha())"]

    def stamped(src):
        env = {**os.environ, "PYTHONPATH": str(src)}
        env.pop("CHRONICALS_GIT_SHA", None)
        return subprocess.check_output(probe, text=True, env=env, cwd=tmp_path).strip()

    assert stamped(repo / "src") == sha
    with (repo / "src" / "chronicals" / "bench" / "shapes.py").open("a") as f:
        f.write("# edited\n")
    assert stamped(repo / "src") == f"{sha}-dirty"
    inside = tmp_path / "other" / "venv" / "site"  # installed into a venv inside another project's checkout
    shutil.copytree(repo / "src" / "chronicals", inside / "chronicals")
    subprocess.run(["git", "init", "-q", str(tmp_path / "other")], check=True)
    subprocess.run([*_GIT, "-C", str(tmp_path / "other"), "commit", "-q", "--allow-empty", "-m", "y"], check=True)
    got = stamped(inside)  # one probe: each imports torch (~3 s on a 2-core CPU)
    assert got != sha and not got.endswith("-dirty")
    assert got.startswith("v") or got == "unknown"


def test_git_sha_is_the_override_else_dirty_only_for_tracked_changes(tmp_path, monkeypatch):
    """CHRONICALS_GIT_SHA, when set, is the stamp (the GPU machine's copied tree may have an older .git; it was
    ignored). Otherwise "-dirty" only when tracked files differ from HEAD: an untracked file (a results folder, a
    scratch script) made the stamp dirty. A stand-in checkout: report.__file__ pointed into a tiny git repo."""
    monkeypatch.setenv("CHRONICALS_GIT_SHA", "feed123-dirty")
    assert report.git_sha() == "feed123-dirty" and report.environment("cpu")["git_sha"] == "feed123-dirty"
    monkeypatch.delenv("CHRONICALS_GIT_SHA")
    mod = tmp_path / "src" / "chronicals" / "bench" / "report.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("# stand-in\n")
    sha = _committed_repo(tmp_path)
    monkeypatch.setattr(report, "__file__", str(mod))
    (tmp_path / "results.json").write_text("{}")  # untracked
    assert report.git_sha() == sha
    mod.write_text("# edited\n")
    assert report.git_sha() == f"{sha}-dirty"


def test_two_runs_choosing_a_name_at_once_get_two_names(tmp_path, monkeypatch):
    """output_stem listed the folder, then write_report wrote later: two runs finishing in the same second both
    chose <name>_<gpu>_<date> and the second overwrote the first. The name is claimed with an exclusive create."""
    from chronicals.bench import report

    monkeypatch.setattr(report.Path, "glob", lambda self, pattern: iter(()))  # both runs listed an empty folder
    first = report.output_stem(_small_results(), tmp_path, name="bench_e2e_0.5b")
    second = report.output_stem(_small_results(), tmp_path, name="bench_e2e_0.5b")
    assert first.name == "bench_e2e_0.5b_NVIDIA-H200_2026-11-30"
    assert second.name == "bench_e2e_0.5b_NVIDIA-H200_2026-11-30_2"
