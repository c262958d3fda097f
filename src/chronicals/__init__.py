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
- ``chronicals.models.generate(model, ids, max_new_tokens)`` and ``chat(model, tokenizer, prompt)``: greedy or
  sampled generation of one prompt, stopping at the model's eos (``eos_token_id=`` sets other stops).
"""

from .models import load_model, load_tokenizer, save_model

__version__ = "0.1.0"

__all__ = ["__version__", "load_model", "load_tokenizer", "save_model"]
