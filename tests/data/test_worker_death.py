"""A tokenizer worker process killed (the kernel's OOM killer, a SIGKILL) while the data is tokenized in processes:
`chronicals train` hung for ever, holding its out_dir lock. The workers inherited the CLI's SIGINT/SIGTERM handler
(raise KeyboardInterrupt), so the pool's SIGTERM to the survivors was caught and they blocked again (a concurrency
walk). Now the run ends with one DataError naming data.num_proc, and a worker dies with its parent."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from smollm2_tokenizer import gguf_path

HERE = Path(__file__).resolve().parent

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, {tests!r})
    import chronicals.data.workers as workers_mod
    from chronicals.data import DataError, load_dataset
    from smollm2_tokenizer import smollm2_tokenizer

    def on_signal(signum, frame):  # what chronicals.cli installs
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    real = workers_mod._encode_chunk
    def encode(records):
        if records[0].data.get("text") == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        return real(records)
    workers_mod._encode_chunk = encode  # the forked workers look it up here
    path = {path!r}
    with open(path, "w") as f:
        for i in range(3 * workers_mod.CHUNK):
            f.write(json.dumps({{"text": "die" if i == workers_mod.CHUNK else f"record {{i}}"}}) + "\\n")
    try:
        load_dataset(path, smollm2_tokenizer(), max_seq_len=32, num_proc=2,
                     option_names={{"num_proc": "data.num_proc"}})
    except DataError as e:
        print("DataError:", e)
""")


@pytest.mark.skipif(sys.platform != "linux", reason="fork and SIGKILL semantics of Linux")
def test_a_killed_tokenizer_worker_ends_the_load_with_one_error(tmp_path):
    gguf_path()  # the child loads the embedded SmolLM2 tokenizer: skip here without the package, not fail there
    script = SCRIPT.format(tests=str(HERE.parent), path=str(tmp_path / "d.jsonl"))
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("load_dataset hung after a tokenizer worker was killed")
    said = out.stdout + out.stderr
    assert out.returncode == 0 and "DataError: a tokenizer worker process died" in said, said
    assert "data.num_proc=1" in said, said


def test_data_num_proc_reaches_the_tokenizer():
    """data.num_proc (train) and --num-proc (eval) choose the processes: the fix the error above names."""
    from chronicals.cli_eval import _DATA_FLAGS, _as_flags
    from chronicals.config import ConfigError, from_dict
    from chronicals.train.setup import _dataset_options

    assert _dataset_options(from_dict({"data": {"num_proc": 3}}).data)["num_proc"] == 3
    assert _dataset_options(from_dict({}).data)["num_proc"] is None  # 0: auto
    with pytest.raises(ConfigError, match=r"data.num_proc=-1 is invalid: expected an integer >= 0"):
        from_dict({"data": {"num_proc": -1}})
    assert "num_proc" in _DATA_FLAGS and _as_flags("set data.num_proc=1") == "set --num-proc=1"


ORPHAN = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, {tests!r})
    import chronicals.data.workers as workers_mod
    from chronicals.data import load_dataset
    from smollm2_tokenizer import smollm2_tokenizer

    def slow(records):  # each worker says its pid (one write: print's pieces of two workers interleaved), then
        os.write(1, f"worker {{os.getpid()}}\\n".encode())  # works for a minute
        time.sleep(60)
    workers_mod._encode_chunk = slow
    path = {path!r}
    with open(path, "w") as f:
        for i in range(3 * workers_mod.CHUNK):
            f.write(json.dumps({{"text": f"record {{i}}"}}) + "\\n")
    load_dataset(path, smollm2_tokenizer(), max_seq_len=32, num_proc=2)
""")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_tokenizer_workers_die_with_a_killed_run(tmp_path):
    """A SIGKILLed run (the OOM killer, a preempted job) left its tokenizer workers running, each holding its share
    of the records; they now get a SIGTERM when their parent dies."""
    import signal
    import time

    gguf_path()  # the child loads the embedded SmolLM2 tokenizer: skip here without the package, not fail there
    script = ORPHAN.format(tests=str(HERE.parent), path=str(tmp_path / "d.jsonl"))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids: set[int] = set()
    try:
        for line in proc.stdout:  # (a run that ends early ends the loop: EOF)
            if line.startswith("worker"):
                pids.add(int(line.split()[1]))
            if len(pids) == 2:
                break
        assert len(pids) == 2, pids
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)]
    finally:
        proc.kill()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
