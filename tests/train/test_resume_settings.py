"""A resume (train.resume=auto) under changed settings: this run's optimizer settings replace the checkpoint's,
and a checkpoint written over other data is warned about.

test_loop.py checks that a changed optim.lr applies and is named; these check the settings the checkpoint's
optimizer state also carries (betas, eps, weight decay), which a resume that restored only the lr would keep
from the old run while its warning says the new ones apply, and the data.path half of the data warning.
"""

from __future__ import annotations

import torch

from chronicals.train import train
from chronicals.train.checkpoint import STATE_FILE, checkpoint_dirs

from train_helpers import SyntheticLoader, tiny_config, tiny_model


def test_resume_applies_this_runs_betas_eps_and_weight_decay(tmp_path, docs, caplog):
    """Steps after a resume run with this run's optim.beta1 / beta2 / eps / weight_decay: the optimizer state
    of the resumed run's checkpoint holds them (vectors still without decay), and the warning names them."""
    old = dict(optim__weight_decay=0.0, optim__beta1=0.8, optim__beta2=0.99, optim__eps=1e-6)
    new = dict(optim__weight_decay=0.1, optim__beta1=0.85, optim__beta2=0.98, optim__eps=1e-7)
    train(tiny_config(tmp_path, train__max_steps=2, **old), model=tiny_model(), train_loader=SyntheticLoader(docs))
    with caplog.at_level("WARNING", logger="chronicals.train"):
        train(tiny_config(tmp_path, train__max_steps=3, train__resume="auto", **new), model=tiny_model(),
              train_loader=SyntheticLoader(docs))
    named = ("optim.beta1=0.8 (this run: 0.85)", "optim.beta2=0.99 (this run: 0.98)",
             "optim.eps=1e-06 (this run: 1e-07)", "optim.weight_decay=0.0 (this run: 0.1)")
    assert all(s in caplog.text for s in named), caplog.text
    last = checkpoint_dirs(tmp_path / "run")[-1]
    assert last.name == "step-000003"
    state = torch.load(last / STATE_FILE, map_location="cpu", weights_only=False)
    groups = {g["name"]: g for g in state["optimizer"]["param_groups"]}
    assert (groups["matrices"]["weight_decay"], groups["vectors"]["weight_decay"]) == (0.1, 0.0)
    assert all(tuple(g["betas"]) == (0.85, 0.98) and g["eps"] == 1e-7 for g in groups.values())


def test_resume_over_another_data_path_warns(tmp_path, docs, caplog):
    """A checkpoint written over another data.path (resume=auto in a reused out_dir) is warned about: its data
    position points into other data. test_loop.py covers a changed data.batch_size only."""
    train(tiny_config(tmp_path, train__max_steps=1, data__path="a.jsonl"), model=tiny_model(),
          train_loader=SyntheticLoader(docs))
    with caplog.at_level("WARNING", logger="chronicals.train"):
        train(tiny_config(tmp_path, train__max_steps=2, train__resume="auto", data__path="b.jsonl"),
              model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert "written with data.path='a.jsonl' (this run: 'b.jsonl'): its data position refers to other batches" \
        in caplog.text
