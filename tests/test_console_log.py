"""The CLI's console log: a warning or an error says so; info lines stay as they were."""

import logging
import subprocess
import sys


def test_warnings_and_errors_say_their_level_in_the_console():
    code = ("import logging\nfrom chronicals.cli_models import _setup_logging\n_setup_logging()\n"
            "log = logging.getLogger('chronicals.train')\nlog.info('an info %d', 1)\nlog.warning('a warning %d', 2)\n"
            "logging.getLogger('chronicals.data').error('an error')\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    lines = [line.split(" ", 1)[1] for line in err.splitlines()]  # after the time
    assert lines == ["chronicals.train: an info 1", "chronicals.train: warning: a warning 2",
                     "chronicals.data: error: an error"], err


def test_the_level_word_does_not_reach_other_handlers():
    from chronicals.cli_models import _LevelFormatter

    rec = logging.LogRecord("chronicals.x", logging.WARNING, __file__, 1, "said %s", ("it",), None)
    assert _LevelFormatter("%(name)s: %(message)s").format(rec) == "chronicals.x: warning: said it"
    assert rec.getMessage() == "said it"
