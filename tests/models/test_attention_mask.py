"""CausalLM.forward with a tokenizer's attention_mask (right padding) against transformers on the same weights,
and the position_ids / attention_mask arguments it refuses.

``model(**tokenizer(texts, padding=True, return_tensors="pt"))``, the commonest transformers call, failed with
TypeError (no attention_mask argument); a 1-D position_ids failed inside rope_qk with a message naming neither."""

import re

import pytest
import torch
import transformers

from chronicals.models import CausalLM, ModelConfig
from chronicals.models.forward_args import mask_padding

TINY = dict(vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, pad_token_id=0)
LENGTHS = [9, 4, 7]  # row i: LENGTHS[i] tokens, then padding to 9


@pytest.fixture(scope="module")
def pair():
    """(ours, transformers') float64 models with the same random weights."""
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).double().eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    ours = CausalLM(ModelConfig.from_hf_dict(hf.config.to_dict()), impl="torch").double().eval()
    ours.load_state_dict(hf.state_dict(), strict=False)
    return ours, hf


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, TINY["vocab_size"], (len(LENGTHS), max(LENGTHS)), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
        ids[i, n:] = TINY["pad_token_id"]
    return ids, mask


def test_logits_of_the_tokens_equal_transformers_and_the_unpadded_rows(pair, batch):
    ours, hf = pair
    ids, mask = batch
    with torch.no_grad():
        got = ours(ids, attention_mask=mask)
        want = hf(input_ids=ids, attention_mask=mask).logits
        for i, n in enumerate(LENGTHS):
            torch.testing.assert_close(got[i, :n], want[i, :n], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(got[i, :n], ours(ids[i:i + 1, :n])[0], rtol=1e-12, atol=1e-12)


def test_loss_leaves_the_padding_out(pair, batch):
    """labels=input_ids with padding: the padding is neither predicted nor a target. transformers gives the same
    loss when its labels are -100 there (what its collators write); gradients equal too."""
    ours, hf = pair
    ids, mask = batch
    hf_labels = ids.masked_fill(mask == 0, -100)
    want = hf(input_ids=ids, attention_mask=mask, labels=hf_labels).loss
    want.backward()
    got = ours(ids, attention_mask=mask, labels=ids)
    got.backward()
    # transformers' loss casts the logits to float32: agreement to float32 rounding
    torch.testing.assert_close(got, want.double(), rtol=1e-6, atol=1e-6)
    hf_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    # the unpadded rows' losses, summed and divided by their target count
    with torch.no_grad():
        total = sum(ours(ids[i:i + 1, :n], labels=ids[i:i + 1, :n], reduction="sum") for i, n in enumerate(LENGTHS))
        torch.testing.assert_close(ours(ids, attention_mask=mask, labels=ids),
                                   total / sum(n - 1 for n in LENGTHS), rtol=1e-12, atol=1e-12)
        aligned = torch.roll(ids, -1, 1)  # shift_labels form: position t's target is token t + 1
        per_token = ours(ids, attention_mask=mask, shift_labels=aligned, reduction="none")
        assert per_token.shape == ids.shape
        for i, n in enumerate(LENGTHS[1:], 1):  # the last token of a padded row would predict padding: no loss
            assert torch.equal(per_token[i, n - 1:], torch.zeros(ids.shape[1] - n + 1, dtype=per_token.dtype))
            assert (per_token[i, :n - 1] > 0).all()
    for p in list(ours.parameters()) + list(hf.parameters()):
        p.grad = None


def test_a_row_without_padding_keeps_its_last_shift_label(pair, batch):
    """In shift_labels form the user supplies the last position's target (e.g. the next chunk's first token): a row
    without padding keeps it beside padded rows; only positions whose token or target is padding lose theirs (every
    row's last target was dropped, the unpadded row's too)."""
    ours, _ = pair
    ids, mask = batch
    targets = torch.arange(10).view(2, 5) + 1
    labels, shift = mask_padding(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), None, targets)
    assert labels is None and shift.tolist() == [[1, 2, 3, 4, 5], [6, 7, -100, -100, -100]]
    aligned = torch.roll(ids, -1, 1)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, shift_labels=aligned, reduction="none")
        want = ours(ids[:1], shift_labels=aligned[:1], reduction="none")
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    assert got[0, -1] > 0


def test_a_mask_of_ones_changes_nothing(pair, batch):
    ours, _ = pair
    ids, _ = batch
    with torch.no_grad():
        ones = torch.ones_like(ids)
        assert torch.equal(ours(ids, attention_mask=ones), ours(ids))
        assert torch.equal(ours(ids, attention_mask=ones.bool(), labels=ids), ours(ids, labels=ids))


def _set(mask, row, col, value):
    mask = mask.clone()
    mask[row, col] = value
    return mask


@pytest.mark.parametrize("mask,match", [
    (lambda m: m.flip(1), r"attention_mask row 1 has padding before a token \(left padding\)"),
    (lambda m: m * 2, "values other than 0 and 1"),
    (lambda m: m.float(), "must be bool or integer .* got torch.float32"),
    (lambda m: m[:, :5], r"attention_mask has shape \(3, 5\) but input_ids has \(3, 9\)"),
    # the exact (B, S) shape: one row's mask is not broadcast onto every row's labels
    (lambda m: m[:1], r"attention_mask has shape \(1, 9\) but input_ids has \(3, 9\)"),
    (lambda m: m[:, None], r"attention_mask has shape \(3, 1, 9\) but input_ids has \(3, 9\)"),
    # a hole after a row's first token is padding before a token too, not silently dropped from the loss
    (lambda m: _set(m, 1, 1, 0), r"attention_mask row 1 has padding before a token"),
    (lambda m: _set(m, 1, 8, 1), r"attention_mask row 1 has padding before a token"),
    # negative values (a label-like mask) and 2 in every integer dtype, not only int64
    *[(lambda m, v=v: m.masked_fill(m == 0, v), "values other than 0 and 1") for v in (-1, -100)],
    *[(lambda m, dt=dt: (m * 2).to(dt), "values other than 0 and 1") for dt in (torch.int32, torch.uint8, torch.int8)],
])
def test_bad_masks_say_what_and_how(pair, batch, mask, match):
    ours, _ = pair
    ids, good = batch
    with pytest.raises(ValueError, match=match):
        ours(ids, attention_mask=mask(good), labels=ids)


def test_a_mask_beside_packed_rows_or_a_count_is_refused(pair, batch):
    ours, _ = pair
    ids, mask = batch
    with pytest.raises(ValueError, match="packed rows"):
        ours(ids, attention_mask=mask, position_ids=torch.zeros_like(ids),
             cu_seqlens=torch.tensor([0, 9, 18, 27], dtype=torch.int32), max_seqlen=9)
    with pytest.raises(ValueError, match="num_loss_tokens counts the targets of an unpadded batch"):
        ours(ids, attention_mask=mask, labels=ids, num_loss_tokens=17)


@pytest.mark.parametrize("pos,match", [
    (lambda s: torch.arange(s), re.escape("position_ids has shape (9,) but input_ids has (3, 9)")),
    (lambda s: torch.arange(s - 1)[None], re.escape("position_ids has shape (1, 8) but input_ids has (3, 9)")),
    (lambda s: torch.arange(s)[None].expand(2, s), re.escape("(2, 9)")),
    (lambda s: torch.arange(s)[None, :, None].expand(3, s, 1), re.escape("position_ids has shape (3, 9, 1)")),
    (lambda s: torch.arange(s, dtype=torch.float32)[None], "position_ids must be int64 or int32"),
])
def test_bad_position_ids_name_the_argument(pair, batch, pos, match):
    ours, _ = pair
    ids, _ = batch
    with pytest.raises(ValueError, match=match):
        ours(ids, position_ids=pos(ids.shape[1]))


def test_position_ids_of_one_row_serve_every_row(pair, batch):
    ours, _ = pair
    ids, _ = batch
    with torch.no_grad():
        pos = torch.arange(3, 3 + ids.shape[1])
        torch.testing.assert_close(ours(ids, position_ids=pos[None]),
                                   ours(ids, position_ids=pos[None].expand_as(ids)), rtol=0, atol=0)


def test_autocast_is_refused_naming_the_dtype_way():
    """Under torch.autocast (a transformers idiom) the decoder failed inside rope / attention on mixed dtypes
    (a Python-API walk); one error now names load_model(..., dtype=) / model.to(dtype)."""
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = CausalLM(cfg).init_weights(seed=0)
    ids = torch.randint(0, 64, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match=r"does not run under torch.autocast: .*dtype=torch.bfloat16"):
            model(ids, labels=ids)
    assert model(ids).shape == (2, 6, 64)
