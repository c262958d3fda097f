"""`chronicals ... | head -1`: a reader that goes away ends the command quietly with 141 (128 + SIGPIPE)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "pipe") or sys.platform == "win32", reason="POSIX pipes")


def run_into_closed_pipe(*args):
    """Run ``python -m chronicals.cli *args`` with stdout a pipe whose reader has already exited (what
    `| head -1` leaves once it has its line: every write gets EPIPE, deterministically)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "chronicals.cli", *args], stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=300)
    finally:
        os.close(w)


def test_train_help_into_a_closed_pipe_exits_quietly_with_141():
    proc = run_into_closed_pipe("train", "--help")
    assert proc.stderr == "", proc.stderr  # was "error: [Errno 32] Broken pipe" (and exit status 3)
    assert proc.returncode == 141


def test_usage_into_a_closed_pipe_exits_quietly_with_141():
    proc = run_into_closed_pipe("--help")
    assert (proc.stderr, proc.returncode) == ("", 141)


def test_help_into_a_reader_still_prints_it_all():
    proc = subprocess.run([sys.executable, "-m", "chronicals.cli", "train", "--help"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith("usage: chronicals train") and "lora.rank" in proc.stdout


def test_a_broken_pipe_elsewhere_is_still_an_error(monkeypatch, capsys):
    """Only stdout's reader going away is quiet: a BrokenPipeError from another pipe (stdout still open) is
    reported as bad input, exit status 3."""
    from chronicals import cli

    def command(argv):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setitem(cli.COMMANDS, "train", command)
    monkeypatch.delenv("CHRONICALS_TRACEBACK", raising=False)
    assert cli.main(["train"]) == 3
    assert "error: [Errno 32] Broken pipe" in capsys.readouterr().err
