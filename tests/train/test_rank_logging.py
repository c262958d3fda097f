"""Under torchrun every rank runs train(): the library's warnings come from rank 0 only (the CLI did this already;
a Python script calling train() under torchrun said each warning once per rank)."""

import logging

import pytest

from chronicals.config import ConfigError
from chronicals.train import train
from chronicals.train.distributed import env_rank, main_rank_tells


@pytest.mark.parametrize("rank", ["0", "1"])
def test_train_warns_on_rank_0_only_and_puts_the_level_back(rank, tmp_path, monkeypatch, caplog):
    ours = logging.getLogger("chronicals")
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    caplog.set_level(logging.INFO)
    # the config's warning comes first; then joining the group fails (no MASTER_ADDR): an error on every rank
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        train(empty)
    assert ("sets nothing" in caplog.text) == (rank == "0"), caplog.text
    assert ours.level == logging.NOTSET  # the caller's setting, back after train()


def test_rank_comes_from_torchrun_only_with_more_than_one_process(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert env_rank() == 0  # a stray RANK (a scheduler's) without WORLD_SIZE: init_distributed runs one process
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert env_rank() == 0
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert env_rank() == 3


def test_other_ranks_keep_errors_and_a_quieter_setting(monkeypatch, caplog):
    ours, child = logging.getLogger("chronicals"), logging.getLogger("chronicals.train")
    monkeypatch.setattr(ours, "level", logging.INFO)
    caplog.set_level(logging.INFO)
    with pytest.raises(KeyError):
        with main_rank_tells(rank=2):
            child.warning("a warning")
            child.error("an error")
            raise KeyError("the level is put back on the way out")
    assert "a warning" not in caplog.text and "an error" in caplog.text
    assert ours.level == logging.INFO
    monkeypatch.setattr(ours, "level", logging.CRITICAL)  # a caller who wants less keeps less
    with main_rank_tells(rank=1):
        assert ours.level == logging.CRITICAL
    with main_rank_tells(rank=0):
        child.warning("rank 0 speaks")
    assert "rank 0 speaks" not in caplog.text  # CRITICAL still: rank 0's level is the caller's, untouched


def test_a_quieter_setting_above_ours_is_kept_on_other_ranks(monkeypatch):
    """The level that counts is the effective one: ours unset under a root that says CRITICAL only stays unset."""
    ours = logging.getLogger("chronicals")
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger(), "level", logging.CRITICAL)
    with main_rank_tells(rank=1):
        assert ours.level == logging.NOTSET and ours.getEffectiveLevel() == logging.CRITICAL
