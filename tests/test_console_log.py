"""The console log: a warning or an error says so; info lines stay as they were. train() called from a script that set
up no logging shows its progress and summary (it said nothing at all: Python's default shows warnings only)."""

import logging
import subprocess
import sys
from pathlib import Path


def test_warnings_and_errors_say_their_level_in_the_console():
    code = ("import logging\nfrom chronicals.cli_models import _setup_logging\n_setup_logging()\n"
            "log = logging.getLogger('chronicals.train')\nlog.info('an info %d', 1)\nlog.warning('a warning %d', 2)\n"
            "logging.getLogger('chronicals.data').error('an error')\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    lines = [line.split(" ", 1)[1] for line in err.splitlines()]  # after the time
    assert lines == ["chronicals.train: an info 1", "chronicals.train: warning: a warning 2",
                     "chronicals.data: error: an error"], err


def test_the_level_word_does_not_reach_other_handlers():
    from chronicals.train.console import LevelFormatter

    rec = logging.LogRecord("chronicals.x", logging.WARNING, __file__, 1, "said %s", ("it",), None)
    assert LevelFormatter("%(name)s: %(message)s").format(rec) == "chronicals.x: warning: said it"
    assert rec.getMessage() == "said it"


def _stderr(code: str) -> list[str]:
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    return [line.split(" ", 1)[1] if line[:2].isdigit() else line for line in err.splitlines()]  # after the time


def test_run_console_speaks_where_nothing_was_set_up_and_goes_away():
    code = ("import logging\nfrom chronicals.train.console import run_console\nlog = logging.getLogger('chronicals.x')\n"
            "with run_console():\n    log.info('inside')\n    log.warning('careful')\n"
            "log.info('after')\nassert not logging.getLogger().handlers\n"
            "assert logging.getLogger('chronicals').level == logging.NOTSET\n")
    assert _stderr(code) == ["chronicals.x: inside", "chronicals.x: warning: careful"]


def test_run_console_keeps_a_program_s_own_logging():
    code = ("import logging, sys\nlogging.basicConfig(level=logging.WARNING, stream=sys.stderr, format='mine %(message)s')\n"
            "from chronicals.train.console import run_console\nlog = logging.getLogger('chronicals.x')\n"
            "with run_console():\n    log.info('inside')\n    log.warning('careful')\n"
            "assert len(logging.getLogger().handlers) == 1\n")
    assert _stderr(code) == ["mine careful"]


def test_train_from_a_script_shows_its_steps(tmp_path):
    """A script calling train() with no logging set up: the step lines reach stderr (a pipe here: the plain-line
    progress of a non-terminal)."""
    code = (f"import sys\nsys.path.insert(0, {str(Path(__file__).parent / 'train')!r})\n"
            "from train_helpers import SyntheticLoader, synthetic_docs, tiny_config, tiny_model\n"
            "from pathlib import Path\nfrom chronicals.train import train\n"
            f"cfg = tiny_config(Path({str(tmp_path)!r}), train__max_steps=3, logging__progress=True)\n"
            "train(cfg, model=tiny_model(), train_loader=SyntheticLoader(synthetic_docs(40)))\n")
    lines = _stderr(code)
    assert any(line.startswith("chronicals.train: step 3/3: loss") for line in lines), lines


def test_train_from_a_script_logs_its_held_out_loss_and_where_its_outputs_went(tmp_path):
    """train() called from a script said its steps and 'saved .../adapter', but neither the held-out loss before and
    after (the numbers a run is for) nor where metrics.jsonl and loss.png went: the README promised its 'progress
    and summary', and the summary was the CLI's alone (printed by RunReport, the CLI's report callback)."""
    code = (f"import sys\nsys.path.insert(0, {str(Path(__file__).parent / 'train')!r})\n"
            "from train_helpers import SyntheticLoader, synthetic_docs, tiny_config, tiny_model\n"
            "from pathlib import Path\nfrom chronicals.train import train\n"
            f"cfg = tiny_config(Path({str(tmp_path)!r}), train__max_steps=2, train__save_final=True,\n"
            "                 lora__enabled=True, logging__plot=True)\n"
            "r = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(synthetic_docs(40)),\n"
            "          eval_loader=SyntheticLoader(synthetic_docs(6, seed=1), shuffle=False))\n"
            "print(f'{r.eval_loss_before:.4f} {r.eval_loss_after:.4f}')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = proc.stdout.split()
    lines = [line.split(" ", 1)[1] for line in proc.stderr.splitlines() if line[:2].isdigit()]
    assert f"chronicals.train: held-out loss before training: {before}" in lines, lines
    run = tmp_path / "run"
    done = [line for line in lines if line.startswith("chronicals.train: done: 2 steps in ")]
    assert len(done) == 1, lines
    assert (f"; held-out loss {before} -> {after}; adapter: {run / 'adapter'}; metrics: {run / 'metrics.jsonl'}; "
            f"loss curve: {run / 'loss.png'}") in done[0], done
