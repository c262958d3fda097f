"""chronicals: fast, memory-lean fine-tuning of decoder LLMs.

    model, tokenizer = chronicals.load_model("smollm2-135m-instruct")  # or an HF directory, or a .gguf file
    logits = model(input_ids)                      # input_ids (B, S) int64 -> logits (B, S, V), a plain tensor
    loss = model(input_ids, labels=input_ids)      # labels shifted inside, as transformers' CausalLM; -100 = no loss
    chronicals.save_model(model, tokenizer, "out/my-model")  # an HF directory transformers loads

``model(**tokenizer(texts, padding=True, return_tensors="pt"), labels=...)`` takes a right-padded batch: rows
attend causally, so the tokens' logits are those of the unpadded rows, and the loss leaves the padding out
(``attention_mask`` 0: never predicted, never a target); left padding is refused. The rest lives in the
subpackages:

- ``chronicals.lora``: ``apply_lora``, ``lora_plus_param_groups``, ``save_adapter`` / ``load_adapter`` (PEFT's
  format), ``merge_lora``;
- ``chronicals.train.train(config)``: the trainer (a ``TrainConfig``, a nested dict of sections or a YAML path;
  ``chronicals.config.load_config(path, ["key=value"])`` builds one), as ``chronicals train`` runs it;
- ``chronicals.models.generate(model, ids, max_new_tokens)``: the new token ids of one prompt, greedy or sampled
  (``temperature=``, ``top_p=``), stopping at the model's eos (``eos_token_id=`` sets other stops);
  ``chat(model, tokenizer, prompt)``: a chat model's greedy answer to one message, as text.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "load_model", "load_tokenizer", "save_model"]


def __getattr__(name: str):
    """``chronicals.load_model`` etc., imported when first used (PEP 562): ``import chronicals`` then loads no torch
    (1.8 s), so the ``chronicals`` command installs its Ctrl-C handling before torch loads; a Ctrl-C in those
    seconds printed a 25-line KeyboardInterrupt traceback from torch's import."""
    if name in ("load_model", "load_tokenizer", "save_model"):
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module 'chronicals' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
