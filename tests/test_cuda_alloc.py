"""The allocator default of chronicals' commands (cuda_alloc): expandable segments unless the user set the variable;
in the bench, for our rows only."""

import os
import subprocess

import pytest

from chronicals import cli
from chronicals.bench import cli as bench_cli
from chronicals.bench.protocol import RunSpec
from chronicals.cuda_alloc import allocator_env, allocator_setting


def test_set_only_when_the_user_set_neither_name():
    assert allocator_env({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {}
    assert allocator_env({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == {}
    assert allocator_setting({}).startswith("PyTorch's default")
    assert allocator_setting({"PYTORCH_ALLOC_CONF": "x"}) == "PYTORCH_ALLOC_CONF=x"
    # both set: the log names both (which one PyTorch reads differs between its releases), not only the first
    both = allocator_setting({"PYTORCH_ALLOC_CONF": "a", "PYTORCH_CUDA_ALLOC_CONF": "b"})
    assert both == "PYTORCH_CUDA_ALLOC_CONF=b and PYTORCH_ALLOC_CONF=a (both set: PyTorch reads one of them)"


@pytest.fixture
def environ(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    monkeypatch.setattr(os, "environ", env)
    return env


def test_a_given_mapping_is_read_as_given_and_none_reads_os_environ(environ):
    """An explicit {} (a scrubbed child env) is that mapping, not the process env; no mapping is os.environ, which
    train() logs as allocator_setting() (read as {}, the log always said PyTorch's default)."""
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:64"
    assert allocator_env({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator_setting({}).startswith("PyTorch's default")
    assert allocator_setting() == "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:64"
    assert allocator_env() == {}
    del environ["PYTORCH_CUDA_ALLOC_CONF"]
    assert allocator_setting().startswith("PyTorch's default")
    assert allocator_env() == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_a_command_sets_it_before_it_runs(environ, tmp_path, capsys):
    assert cli.main(["chat", "--model", str(tmp_path / "absent"), "hi"]) != 0  # fails at once, after the setting
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_a_users_setting_is_kept(environ, tmp_path, capsys):
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:128"
    cli.main(["chat", "--model", str(tmp_path / "absent"), "hi"])
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


def test_bench_sets_it_for_our_rows_only(environ, monkeypatch):
    seen = {}

    def fake_run(cmd, env, **kw):
        seen[cmd[cmd.index("--contender") + 1] if "--contender" in cmd else "?"] = env.get("PYTORCH_CUDA_ALLOC_CONF")
        return subprocess.CompletedProcess(cmd, 1, "", "")

    monkeypatch.setattr(bench_cli.subprocess, "run", fake_run)
    runner = bench_cli.Runner(timeout=5, log=lambda *a: None)
    for name in ("chronicals-full", "hf-sdpa"):
        runner.run("contender", RunSpec(name, shape="tiny", device="cpu"))
    assert seen == {"chronicals-full": "expandable_segments:True", "hf-sdpa": None}
    assert "PYTORCH_CUDA_ALLOC_CONF" not in environ  # the bench process itself (and so the anchors) unchanged
