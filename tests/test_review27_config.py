"""Mutation testing (session 27): the defaults every run (and the demo's numbers in the README) rely on, and
train.keep_last = 0 refused (no checkpoint would ever be pruned)."""

from __future__ import annotations

import pytest

from chronicals.config import ConfigError, from_dict


def test_documented_training_defaults():
    cfg = from_dict({})
    assert cfg.optim.grad_clip == 1.0  # "clip the global gradient norm to this"
    assert cfg.schedule.warmup_steps == 3 and cfg.schedule.kind == "cosine" and cfg.schedule.min_lr_ratio == 0.1
    assert cfg.data.train_on == "assistant"  # loss on replies only
    assert cfg.train.keep_last == 2 and cfg.train.grad_accum == 1


def test_keep_last_zero_is_refused():
    with pytest.raises(ConfigError, match="train.keep_last"):
        from_dict({}, ["train.keep_last=0"])
