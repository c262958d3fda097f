"""Defects a walk of ``chronicals eval`` found outside the eval code: each is one clear error (or a skip under
data.on_error=skip), never a traceback or advice that does not fit the caller."""

from __future__ import annotations

import pytest

from chronicals.cli import main
from chronicals.config import MAX_ROW_TOKENS


@pytest.mark.parametrize("override, key", [
    ("data.max_seq_len=99999999999999999999", "data.max_seq_len"),  # was OverflowError in packing, exit 4
    (f"data.max_seq_len={MAX_ROW_TOKENS + 1}", "data.max_seq_len"),
    ("data.tokens_per_batch=99999999999999999999", "data.tokens_per_batch"),
])
def test_a_row_past_the_token_bound_exits_2_before_any_model_loads(override, key, capsys):
    assert main(["train", override]) == 2
    err = capsys.readouterr().err
    assert f"config {key}=" in err and f"{MAX_ROW_TOKENS}]" in err and "Traceback" not in err, err
