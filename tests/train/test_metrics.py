"""Training metrics: MFU counts the FLOPs the method really does; the peak probe leaves the RNG alone;
metrics.jsonl is strict JSON, read back with integer steps only; loss.png is drawn from whatever losses there are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from chronicals.train import train
from chronicals.train.metrics import (MetricsLog, _json_line, head_flops_per_token, matmul_params, matmul_peak_tflops,
                                      plot_losses, read_records, train_flops_per_token)

from train_helpers import SyntheticLoader, strict_json, tiny_config, tiny_model


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_mfu_counts_the_methods_flops(tmp_path, docs, lora):
    """LoRA computes no weight-gradient GEMM for frozen weights: 4 x matmul params per token, not 6. The loss head
    runs on loss tokens only, so its FLOPs count per loss token (they were counted for every token, padding and
    masked prompts too)."""
    cfg = tiny_config(tmp_path, train__max_steps=2, logging__peak_tflops=1.0, lora__enabled=lora, lora__rank=4,
                      data__max_seq_len=32)
    model, loader = tiny_model(), SyntheticLoader(docs, row_len=32, shuffle=False)
    ga = cfg.train.grad_accum
    computed = [sum(b.input_ids.numel() for b in loader.batches[k * ga:(k + 1) * ga]) for k in range(2)]
    lossy = [sum(b.num_loss_tokens for b in loader.batches[k * ga:(k + 1) * ga]) for k in range(2)]
    assert all(m < n for m, n in zip(lossy, computed))  # padding: fewer loss tokens than computed ones
    train(cfg, model=model, train_loader=loader)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["kind"] == "train"]
    assert len(recs) == 2
    per_token = train_flops_per_token(model.config, 32, "lora" if lora else "full")
    full = model.config.flops_per_token(32)
    assert (per_token < full - matmul_params(model.config)) if lora else per_token == full
    head = (4 if lora else 6) * model.config.vocab_size * model.config.hidden_size
    assert head == head_flops_per_token(model.config, "lora" if lora else "full")
    for r, n, m in zip(recs, computed, lossy):  # the body for every computed token, padding included
        assert r["mfu"] == pytest.approx(((per_token - head) * n + head * m) / r["step_s"] / 1e12, rel=1e-9)



def test_the_flop_helpers_refuse_a_method_other_than_full_or_lora():
    """head_flops_per_token refuses an unknown method as train_flops_per_token does: it returned the LoRA head's
    4 V h for any name ("qlora", "Full", ""), so an MFU for a method it does not know came out quietly wrong."""
    cfg = tiny_model().config
    for method in ("qlora", "Full", ""):
        with pytest.raises(ValueError, match=f"method {method!r} is not 'full' or 'lora'"):
            head_flops_per_token(cfg, method)
        with pytest.raises(ValueError, match=f"method {method!r} is not 'full' or 'lora'"):
            train_flops_per_token(cfg, 32, method)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="the peak is measured on CUDA only")
def test_peak_probe_leaves_the_cuda_rng_alone():
    """The trainer probes the peak after restoring a checkpoint's RNG: drawing its operands from the global
    CUDA generator would change a resumed run's dropout masks."""
    dev = torch.device("cuda")
    before = torch.cuda.get_rng_state(dev)
    assert matmul_peak_tflops(dev, n=512) > 0
    assert torch.equal(torch.cuda.get_rng_state(dev), before)


def test_peak_is_none_off_cuda():
    assert matmul_peak_tflops(torch.device("cpu")) is None


def test_peak_is_the_matmuls_flops_over_its_median_time(monkeypatch):
    """An (n x n) @ (n x n) matmul is 2 n^3 FLOPs, timed by triton's do_bench as a median in ms: n = 64 at 0.5 ms is
    1.05 GFLOP/s. The operands are made on the CPU here (as the CUDA device's would be) so the arithmetic runs
    anywhere."""
    import triton.testing

    generator, randn, asked = torch.Generator, torch.randn, {}
    monkeypatch.setattr(torch, "Generator", lambda device: generator())
    monkeypatch.setattr(torch, "randn", lambda *shape, device, **kw: randn(*shape, **kw))
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: asked.update(kw, out=fn()) or 0.5)
    assert matmul_peak_tflops(torch.device("cuda"), n=64) == pytest.approx(2 * 64**3 / 0.5e-3 / 1e12, rel=1e-12)
    assert asked["return_mode"] == "median" and asked["out"].shape == (64, 64)


def test_the_grad_norm_of_bf16_gradients_is_fp32():
    """clip_grad_norm_ gave the norm in the gradients' dtype: 20.125 for a bf16 norm of 20.1425. Ours: the fp32
    norm of the same gradients, clipped by it as torch clips."""
    from chronicals.train.step import clip_grad_norm

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (1000, 7, 333)]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.37).bfloat16()
    want = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in params]))
    grads = [p.grad.clone() for p in params]
    total = clip_grad_norm(params, float("inf"))
    assert total.dtype == torch.float32 and abs(total.item() / want.item() - 1) < 1e-6
    assert all(torch.equal(p.grad, g0) for p, g0 in zip(params, grads))  # not clipped
    clip_grad_norm(params, 1.0)
    torch.testing.assert_close(torch.linalg.vector_norm(torch.cat([p.grad.float() for p in params])),
                               torch.tensor(1.0), rtol=1e-2, atol=0)  # bf16 gradients, scaled to norm 1


def test_float64_gradients_keep_a_float64_norm():
    """A model.dtype=float64 run crashed at its first step once the norm was taken in fp32 (foreach_norm refuses to
    narrow float64); it is float64 there, and mixed lists take the wider dtype."""
    from chronicals.train.step import clip_grad_norm

    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in ((50, torch.float64), (9, torch.float32))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    want = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in params]))
    total = clip_grad_norm(params, float("inf"))
    assert total.dtype == torch.float64 and abs(total.item() / want.item() - 1) < 1e-7  # the fp32 part in fp32
    only = params[:1]
    assert abs(clip_grad_norm(only, float("inf")).item() - torch.linalg.vector_norm(only[0].grad).item()) < 1e-12


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_float64_run_trains(tmp_path, docs, lora):
    """model.dtype=float64 (the CPU reference runs) crashed at the first step on the fp32 grad norm."""
    cfg = tiny_config(tmp_path, train__max_steps=2, model__dtype="float64", lora__enabled=lora, lora__rank=4)
    res = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs))
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert res.status == "completed" and all(r["grad_norm"] > 0 for r in recs if r["kind"] == "train")


def test_a_full_disk_while_appending_a_record_names_metrics_jsonl(tmp_path):
    """The per-step append's OSError named no file ('error: [Errno 28] No space left on device'; a checkpoint
    walk): it names metrics.jsonl and the fix."""
    import errno
    import os

    log = MetricsLog(tmp_path, False)
    log.write({"kind": "train", "step": 1})

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def seek(self, pos, whence=0):
            return 0

        def truncate(self, size=None):
            return size

    log._fh = Full()
    with pytest.raises(OSError, match=r"could not append to .*metrics.jsonl \(\[Errno 28\] No space left on device\); "
                                      r"is its disk full\?"):
        log.write({"kind": "train", "step": 2})


def test_a_full_disk_mid_record_leaves_whole_records_and_its_error(tmp_path, monkeypatch):
    """A full disk takes the part of a record that fits, then refuses the rest (ENOSPC). The record's half stayed
    in metrics.jsonl, and the rest in Python's buffer, which close() (the loop's cleanup) wrote again: its bare
    'error: [Errno 28] No space left on device' replaced the one naming metrics.jsonl (a 1 MB tmpfs walk). The file
    ends in a whole record, and close() raises nothing."""
    import errno
    import io
    import os

    class FullDisk(io.RawIOBase):  # the kernel's way: a short write of what fits, then ENOSPC
        def __init__(self, path, room):
            self.fd, self.room = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), room

        def writable(self):
            return True

        def write(self, b):
            if self.room == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = os.write(self.fd, bytes(b[:self.room]))
            self.room -= n
            return n

        def seek(self, pos, whence=0):
            return os.lseek(self.fd, pos, whence)

        def truncate(self, size=None):
            os.ftruncate(self.fd, size)
            return size

        def fileno(self):
            return self.fd

        def close(self):
            if not self.closed:
                os.close(self.fd)
            super().close()

    real_open = Path.open

    def open_on_a_full_disk(self, mode="r", buffering=-1, *a, **k):
        if self.name != "metrics.jsonl" or "a" not in mode:
            return real_open(self, mode, buffering, *a, **k)
        raw = FullDisk(self, room=len(_json_line({"kind": "train", "step": 1})) + 20)  # one record and 20 bytes
        if buffering == 0:
            return raw
        fh = io.BufferedWriter(raw)
        return fh if "b" in mode else io.TextIOWrapper(fh, encoding=k.get("encoding"))

    monkeypatch.setattr(Path, "open", open_on_a_full_disk)
    log = MetricsLog(tmp_path, False)
    log.write({"kind": "train", "step": 1})
    with pytest.raises(OSError, match=r"could not append to .*metrics.jsonl \(\[Errno 28\] No space left"):
        log.write({"kind": "train", "step": 2, "loss": 1.5})
    log.close()  # the loop closes the log as the error goes up: nothing is written again, nothing raised
    assert (tmp_path / "metrics.jsonl").read_text() == _json_line({"kind": "train", "step": 1})


def test_a_written_record_is_in_metrics_jsonl_before_the_log_closes(tmp_path):
    """Each record is flushed to metrics.jsonl as it is written, not left in Python's buffer until close: `tail -f`
    shows the steps, and a run killed with SIGKILL (the OOM killer, a preempted job) keeps its records for the
    resume to read back. Unflushed, the file was empty until the log closed."""
    log = MetricsLog(tmp_path, False)
    try:
        for step in (1, 2, 3):
            log.write({"kind": "train", "step": step, "loss": 1.0 / step, "loss_tokens": 7})
            lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
            assert [json.loads(x)["step"] for x in lines] == list(range(1, step + 1))
        assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl", 2)] == [1, 2, 3]
    finally:
        log.close()


def test_metrics_jsonl_writes_every_non_finite_number_as_null(tmp_path):
    """NaN, +inf and -inf are all written as null, so metrics.jsonl is strict JSON; with NaN alone nulled, a diverging
    run's inf loss or grad norm was written as `Infinity`, which JSON.parse and other strict readers refuse."""
    line = _json_line({"kind": "train", "step": 1, "loss": float("inf"), "grad_norm": float("-inf"),
                       "lr": float("nan"), "loss_tokens": 3})
    assert strict_json(line) == {"kind": "train", "step": 1, "loss": None, "grad_norm": None, "lr": None,
                                  "loss_tokens": 3}
    log = MetricsLog(tmp_path, False)
    log.write({"kind": "eval", "step": 2, "eval_loss": float("inf"), "tag": "interval"})
    log.close()
    assert strict_json((tmp_path / "metrics.jsonl").read_text())["eval_loss"] is None


def test_a_resume_refuses_a_record_whose_step_is_a_bool(tmp_path):
    """read_records (a resume reading metrics.jsonl) refuses `"step": true` naming its line, as it refuses a string
    step (an isinstance check let the bool through as step 1); a record with no step is kept."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "train", "step": true}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: its step is True, not an integer"):
        read_records(path, 1)
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "eval", "tag": "before"}\n')
    assert [r.get("step") for r in read_records(path, 1)] == [1, None]


def test_a_resume_skips_lines_of_whitespace_in_metrics_jsonl(tmp_path):
    """read_records skips a line of only whitespace (a CRLF file's blank "\\r" line, spaces, a tab) as it skips an
    empty one; such a line made the resume fail with "not a JSON record". A line with text that is not JSON is
    still refused, naming its line."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"kind": "train", "step": 1}\r\n  \n\t\r\n{"kind": "train", "step": 2}\r\n\r\n'
                     b'{"kind": "eval", "step": 2, "tag": "after"}\n')
    assert [(r["kind"], r["step"]) for r in read_records(path, 2)] == [("train", 1), ("train", 2), ("eval", 2)]
    path.write_text('{"step": 1}\n x\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        read_records(path, 2)


def test_held_out_losses_alone_are_plotted(tmp_path):
    """loss.png is drawn from held-out losses when there is no training loss yet (a run stopped in its first step,
    after its "before" evaluation); it was skipped whenever no train loss was there. Neither: None, no file."""
    recs = [{"kind": "eval", "step": 0, "eval_loss": 3.0, "tag": "before"},
            {"kind": "train", "step": 1, "loss": float("nan")}]  # a non-finite train loss is no point
    out = plot_losses(recs, tmp_path / "loss.png")
    assert out == tmp_path / "loss.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_losses([{"kind": "train", "step": 1, "loss": None}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_closing_the_log_releases_metrics_jsonl(tmp_path):
    """close() closes metrics.jsonl: a process that runs several trainings (a sweep in one interpreter, a notebook)
    keeps no finished run's file open."""
    import os
    from pathlib import Path

    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        pytest.skip("needs /proc/self/fd to list the open files")

    def open_files() -> set[str]:
        out = set()
        for fd in os.listdir(fds):
            try:
                out.add(os.readlink(fds / fd))
            except OSError:  # the listing's own descriptor, closed by now
                pass
        return out

    path = os.path.realpath(tmp_path / "metrics.jsonl")
    log = MetricsLog(tmp_path, False)
    log.write({"kind": "train", "step": 1, "loss": 1.0})
    assert path in open_files()
    log.close()
    assert path not in open_files()


def test_no_loss_curve_is_drawn_when_every_loss_is_non_finite(tmp_path):
    """A run whose every loss is NaN or inf (one that diverged at its first step, its records still floats in memory)
    has no point to draw: no loss.png, None."""
    recs = [{"kind": "train", "step": 1, "loss": float("nan")}, {"kind": "train", "step": 2, "loss": float("inf")},
            {"kind": "eval", "step": 2, "eval_loss": float("nan"), "tag": "after"}]
    assert plot_losses(recs, tmp_path / "loss.png") is None
    assert not (tmp_path / "loss.png").exists()


def test_a_metrics_jsonl_that_is_not_utf8_is_refused_naming_it(tmp_path):
    """A resume reading a metrics.jsonl that is not UTF-8 text gets a ValueError, as for any bad record, naming the
    file, the byte and the way out."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"kind": "train", "step": 1}\n{"kind": "\xff"}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl is not UTF-8 text \(invalid start byte at byte 39\); move it "
                                         r"away \(a new one then holds the steps from 3 on\)"):
        read_records(path, 2)


def test_the_loss_plot_of_a_short_run_ticks_whole_steps(tmp_path, monkeypatch):
    """A 4-step run's loss.png had x ticks at 1.5, 2.5, ... (a user walk): steps are whole numbers."""
    from matplotlib.figure import Figure

    seen = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(fig) or save(fig, *a, **k))
    recs = [{"kind": "train", "step": s, "loss": 2.0 - 0.1 * s} for s in (1, 2, 3, 4)]
    assert plot_losses(recs, tmp_path / "loss.png") is not None
    ticks = [t for t in seen[0].axes[0].get_xticks() if 1 <= t <= 4]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
