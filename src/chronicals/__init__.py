"""chronicals: fast, memory-lean fine-tuning of decoder LLMs.

    model, tokenizer = chronicals.load_model("smollm2-135m-instruct")  # or an HF directory, or a .gguf file
    logits = model(input_ids)                      # input_ids (B, S) int64 -> logits (B, S, V), a plain tensor
    loss = model(input_ids, labels=input_ids)      # labels shifted inside, as transformers' CausalLM; -100 = no loss
    chronicals.save_model(model, tokenizer, "out/my-model")  # an HF directory transformers loads

There is no ``attention_mask``: rows attend causally, so right-padded rows give their real positions' logits
unchanged (set the labels of padding to -100); left padding is not supported. The rest lives in the subpackages:

- ``chronicals.lora``: ``apply_lora``, ``lora_plus_param_groups``, ``save_adapter`` / ``load_adapter`` (PEFT's
  format), ``merge_lora``;
- ``chronicals.train.train(config)``: the trainer (a ``TrainConfig``, a nested dict of sections or a YAML path;
  ``chronicals.config.load_config(path, ["key=value"])`` builds one), as ``chronicals train`` runs it;
- ``chronicals.models.generate(model, ids, max_new_tokens)`` and ``chat(model, tokenizer, prompt)``: greedy or
  sampled generation of one prompt.
"""

from .models import load_model, load_tokenizer, save_model

__version__ = "0.1.0"

__all__ = ["__version__", "load_model", "load_tokenizer", "save_model"]
