"""Mutation testing (session 27): evaluate() refuses a negative qa_limit (it had dropped the last question: qa[:-1]),
max_new_tokens below 1 and a bool limit, naming the argument, before any data is read."""

from __future__ import annotations

import pytest
import torch

from chronicals.config import DataSection
from chronicals.evaluate import evaluate


@pytest.mark.parametrize("kw, says", [({"qa_limit": -1}, "qa_limit=-1"), ({"max_new_tokens": 0}, "max_new_tokens=0"),
                                      ({"qa_limit": True}, "qa_limit=True")])
def test_bad_limits_are_refused_naming_the_argument(kw, says, tmp_path):
    data = DataSection(path=str(tmp_path / "never-read.jsonl"))
    with pytest.raises(ValueError, match=f"evaluate: {says} must be a whole number"):
        evaluate(None, None, data, torch.device("cpu"), **kw)
