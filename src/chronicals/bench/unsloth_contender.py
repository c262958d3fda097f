"""Unsloth on the protocol: a random-init checkpoint saved by transformers, loaded by FastLanguageModel.

Unsloth patches transformers when imported, so the worker imports ``unsloth`` first in its own process
(``worker.py`` does this before anything imports transformers). No hub access: the checkpoint directory
holds the random-init weights and a small tokenizer built locally with the ``tokenizers`` library, and
the worker runs with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from .protocol import LR_FULL, LR_LORA, RunSpec, make_optimizer
from .shapes import LORA_TARGETS, Shape


def save_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer of a few tokens (ids 0..3 special): enough for loaders that need one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(min(60, vocab_size - 4))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>", model_max_length=1 << 20)
    fast.save_pretrained(directory)


def save_random_init(shape: Shape, device: torch.device, seed: int, directory: Path) -> Path:
    """transformers' random-init model of ``shape`` (bf16) plus a tokenizer, saved to ``directory``."""
    from .contenders import build_hf_model

    model = build_hf_model(shape, device, seed)
    model.save_pretrained(directory)
    save_tokenizer(directory, shape.hf_config["vocab_size"])
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return directory


def build_unsloth(spec: RunSpec, shape: Shape, device: torch.device, method: str):
    from unsloth import FastLanguageModel  # already imported first by the worker

    from .contenders import Built, hf_style

    if device.type != "cuda":
        raise RuntimeError("Unsloth needs a CUDA GPU")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    directory = Path(tempfile.mkdtemp(prefix=f"chronicals-bench-{shape.name}-"))
    save_random_init(shape, device, spec.seed, directory)
    ckpt = "unsloth" if spec.checkpointing else False
    model, _ = FastLanguageModel.from_pretrained(
        model_name=str(directory), max_seq_length=spec.seq, dtype=torch.bfloat16, load_in_4bit=False,
        full_finetuning=method == "full", use_gradient_checkpointing=ckpt, local_files_only=True)
    notes = [f"checkpointing={ckpt}"]
    if method == "lora":
        model = FastLanguageModel.get_peft_model(
            model, r=spec.lora_r, lora_alpha=spec.lora_alpha, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
            bias="none", use_gradient_checkpointing=ckpt, random_state=spec.seed)
        notes.append(f"get_peft_model r={spec.lora_r} alpha={spec.lora_alpha}")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer([{"params": params}], device, spec.lr or (LR_LORA if method == "lora" else LR_FULL))
    prepare, fb = hf_style(lambda ids: model(input_ids=ids, labels=ids, use_cache=False).loss)
    return Built(model, prepare, fb, params, opt, shape.hf_config["vocab_size"], notes)
