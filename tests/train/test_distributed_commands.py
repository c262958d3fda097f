"""Commands other than train under torchrun: export, eval, chat, generate and bench are one job each, not data
parallel, so rank 0 alone runs them and every other rank exits 0 after one line (each rank ran the whole command:
two evals, two exports writing one --out, two chats sharing stdin, whose rank 1 found no line and failed the job)."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from chronicals.cli import main


def _as_rank(monkeypatch, rank: int, world: int = 2) -> None:
    """torchrun's variables for rank ``rank`` of ``world`` (no process group: these commands make none)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(rank))


@pytest.mark.parametrize("argv", [["export", "--model", "{base}", "--out", "{out}"],
                                  ["eval", "--model", "{base}", "demo", "--json", "{out}.json"],
                                  ["chat", "--model", "{base}"], ["generate", "--model", "{base}", "hi"],
                                  ["bench", "--quick"]], ids=lambda a: a[0])
def test_a_rank_other_than_0_runs_no_command_but_train(argv, tmp_path, monkeypatch, capsys):
    """Rank 1 of 2 exits 0 at once with one line: nothing loaded (the model path does not exist), nothing written,
    no stdin read (a piped prompt is rank 0's to answer)."""
    _as_rank(monkeypatch, 1)
    stdin = io.StringIO("a question\n")
    monkeypatch.setattr("sys.stdin", stdin)
    args = [a.format(base=tmp_path / "no-model", out=tmp_path / "out") for a in argv]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out == "" and err == (f"rank 1 of 2: chronicals {argv[0]} runs once, on rank 0 (only train is data "
                                 f"parallel; run {argv[0]} without torchrun)\n"), err
    assert list(tmp_path.iterdir()) == [] and stdin.tell() == 0


def test_rank_0_runs_the_command_as_one_process_would(tmp_path, monkeypatch, capsys):
    _as_rank(monkeypatch, 0)
    assert main(["export", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "out")]) == 3
    assert "no-model" in capsys.readouterr().err


def _torchrun(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 -m chronicals.cli ARGS`` on the CPU (a free port of its own)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "chronicals.cli", *args], input=stdin, capture_output=True, text=True, timeout=300)


def test_export_under_torchrun_writes_once(tiny_base, tmp_path):
    """Two ranks each loaded the model and wrote --out, one after the other (two temporary copies at once)."""
    proc = _torchrun("export", "--model", str(tiny_base), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("as a Hugging Face directory") == 1, proc.stdout
    assert proc.stderr.count("chronicals export runs once, on rank 0") == 1, proc.stderr
    assert (tmp_path / "out" / "config.json").is_file()


def test_piped_chat_under_torchrun_answers_each_prompt_once(tiny_base):
    """Both ranks read the one stdin: rank 0 took the line, rank 1 found none ("error: no prompt", exit 2) and
    torchrun stopped rank 0 before it answered: the job failed with no answer."""
    proc = _torchrun("chat", "--model", str(tiny_base), "--max-new-tokens", "2", stdin="first\nsecond\n")
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout.count("> first\n"), proc.stdout.count("> second\n")) == (1, 1), proc.stdout
