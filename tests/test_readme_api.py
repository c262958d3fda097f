"""The README's "Using it" Python block, run as written: its code lines on the embedded SmolLM2 (with the two names
it leaves to the reader, ``input_ids`` and ``texts``, given here), and the calls its comments show (the
``chronicals.lora`` imports, ``train()`` on the named recipe's YAML, ``load_adapter`` then ``train(cfg, model=,
tokenizer=)``) on a tiny Llama with the embedded tokenizer. Each check is a claim of the block's comments; a README
edit that breaks a shown call fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

import chronicals
from chronicals.config_schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme_block() -> str:
    """The ```python block right under '## Using it' (its text between the fences)."""
    m = re.search(r"^## Using it\n+```python\n(.*?)^```", README.read_text(), re.S | re.M)
    assert m, f"{README}: no ```python block under '## Using it' (this test runs that block)"
    return m.group(1)


def shown(pattern: str, block: str) -> re.Match:
    m = re.search(pattern, block)
    assert m, f"{README}, the '## Using it' block: no call matching {pattern!r}; update this test with the README"
    return m


def mean_next_token_loss(logits: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (B, S, V) at position t against ids[:, t + 1], over the t whose target is kept."""
    per = F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), ids[:, 1:].flatten(), reduction="none")
    mask = keep[:, 1:].flatten().bool()
    return per[mask].mean()


@pytest.mark.slow
def test_the_blocks_code_runs_as_written_and_does_what_its_comments_say(tmp_path, monkeypatch, one_thread):
    block = readme_block()
    code = "\n".join(line for line in block.splitlines() if not line.lstrip().startswith("#"))
    monkeypatch.chdir(tmp_path)  # save_model's "out/my-model" is relative
    input_ids = torch.tensor([[1, 504, 3458, 314, 260, 3575, 282, 2, 17]])  # (1, 9): any ids below the vocabulary
    texts = ["Hi!", "What is the capital of Vellmora?"]  # two lengths: the first row gets padding
    ns = {"input_ids": input_ids, "texts": texts}
    exec(compile(code, str(README), "exec"), ns)
    model, tokenizer, batch = ns["model"], ns["tokenizer"], ns["batch"]
    vocab = model.config.vocab_size

    # logits = model(input_ids)  # (B, S, V)
    assert ns["logits"].shape == (1, input_ids.shape[1], vocab)
    with torch.no_grad():
        # loss = model(input_ids, labels=input_ids)  # a scalar: mean over labels != -100, shifted inside
        loss = model(input_ids, labels=input_ids)
        assert loss.dim() == 0
        want = mean_next_token_loss(ns["logits"], input_ids, torch.ones_like(input_ids))
        torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)

        # batch = tokenizer(texts, padding=True, ...)  # padded on the right
        mask = batch["attention_mask"]
        assert bool((mask == 0).any()), "texts of two lengths: one row is padded"
        assert torch.equal(mask, mask.sort(dim=1, descending=True).values), mask  # 1s, then 0s: right padding
        # loss = model(**batch, labels=batch["input_ids"])  # the padding is left out of the loss
        want = torch.stack([F.cross_entropy(model(ids[None, :n])[0, :-1].double(), ids[1:n], reduction="sum")
                            for ids, n in zip(batch["input_ids"], mask.sum(dim=1).tolist())]).sum()
        torch.testing.assert_close(ns["loss"].double(), want / int((mask.sum(dim=1) - 1).sum()), rtol=1e-5, atol=1e-5)

        # (left is refused)
        left = dict(batch, attention_mask=mask.flip(1), input_ids=batch["input_ids"].flip(1))
        with pytest.raises(ValueError, match="left padding"):
            model(**left, labels=left["input_ids"])

    # chronicals.save_model(model, tokenizer, "out/my-model")  # an HF directory transformers loads
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "my-model", torch_dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out" / "my-model")
    assert tok(texts[1])["input_ids"] == tokenizer(texts[1])["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids).logits, ns["logits"], rtol=1e-4, atol=1e-4)


def test_the_calls_its_comments_show_run(tiny_base, tmp_path, monkeypatch):
    """The commented calls, on a tiny Llama with the embedded tokenizer (``tiny_base``) in place of SmolLM2 and two
    steps of the recipe the block names: train() on its YAML path, then load_adapter and train(cfg, model=, tokenizer=)
    on the adapter it wrote, whose settings the run keeps (another lora.rank is refused)."""
    block = readme_block()
    names = shown(r"from chronicals\.lora import ([\w, ]+)", block).group(1)
    ns: dict = {}
    exec(f"from chronicals.lora import {names}", ns)
    exec(shown(r"from chronicals\.train import train", block).group(0), ns)
    train, load_adapter = ns["train"], ns["load_adapter"]

    recipe = ROOT / shown(r'train\("([^"]+\.yaml)"\)', block).group(1)
    cfg = yaml.safe_load(recipe.read_text())  # the recipe, cut to two steps on the tiny model
    cfg["model"]["path"] = str(tiny_base)
    cfg["data"] |= {"max_seq_len": 64, "batch_size": 2}
    cfg["train"] |= {"max_steps": 2, "out_dir": str(tmp_path / "run")}
    cfg["eval"] = {"qa": False}
    cfg["logging"] = {"progress": False, "plot": False, "tensorboard": False}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)

    result = train(str(path))  # train("configs/....yaml"): a path
    # it returns a TrainResult (status, step, final_dir, eval_loss_before/_after, ...)
    fields = shown(r"returns a TrainResult \(([^)]*)\.\.\.\)", block).group(1)
    for field in re.findall(r"\w+", fields.replace("eval_loss_before/_after", "eval_loss_before eval_loss_after")):
        assert hasattr(result, field), field
    assert result.status == "completed" and result.step == 2
    assert isinstance(result.eval_loss_before, float) and isinstance(result.eval_loss_after, float)
    assert (result.final_dir / "adapter_config.json").is_file()

    # training on from an adapter: load_adapter(model, "runs/demo/adapter"), then train(cfg, model=..., tokenizer=...)
    shown(r"load_adapter\(model, \"[^\"]+\"\), then\s*#?\s*train\(cfg, model=model, tokenizer=tokenizer\)", block)
    model, tokenizer = chronicals.load_model(tiny_base)
    load_adapter(model, result.final_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    cfg["train"]["out_dir"] = str(tmp_path / "run2")
    again = train(cfg, model=model, tokenizer=tokenizer)
    assert again.status == "completed"
    after = dict(model.named_parameters())
    assert before and any(not torch.equal(p, after[n]) for n, p in before.items())  # its adapters trained

    other, tokenizer = chronicals.load_model(tiny_base)
    load_adapter(other, result.final_dir)
    rank = cfg["lora"]["rank"]
    cfg["lora"]["rank"] = 2 * rank  # lora.* set otherwise is refused
    cfg["train"]["out_dir"] = str(tmp_path / "run3")
    refusal = rf"already has LoRA adapters .* lora\.rank={2 * rank} \(the adapters': {rank}\)"
    with pytest.raises(ConfigError, match=refusal):
        train(cfg, model=other, tokenizer=tokenizer)
