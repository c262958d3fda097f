"""Packed rows give exactly the per-document loss and every parameter gradient (our decoder, float32); the last
token of each packed document predicts nothing."""

import numpy as np
import pytest
import torch
import transformers
from test_decoder import _cfg

from chronicals.data import collate_rows, pack_bfd
from chronicals.models import CausalLM
from chronicals.models.config import ModelConfig
from chronicals.models.decoder import shift_labels_per_document


def tiny_model():
    hf = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  tie_word_embeddings=False)
    return CausalLM(ModelConfig.from_hf_dict(hf.to_dict()), impl="torch").init_weights(std=0.2, seed=0)


def test_packed_equals_per_document():
    rng = np.random.default_rng(0)
    docs = []
    for n in [5, 17, 3, 11, 29, 2, 8, 13]:
        ids = rng.integers(1, 97, n)
        trainable = rng.random(n) < 0.6
        trainable[-1] = True
        docs.append((ids, trainable))
    model = tiny_model()
    params = dict(model.named_parameters())

    # reference: each document alone, its own row, positions 0..n-1, no cu_seqlens
    model.zero_grad()
    ref_loss = 0.0
    for ids, trainable in docs:
        one = collate_rows([[(ids, trainable)]], len(ids), pad_id=0)
        loss = model(one.input_ids, shift_labels=one.shift_labels, reduction="sum")
        loss.backward()
        ref_loss += loss.item()
    ref_grads = {k: p.grad.clone() for k, p in params.items()}

    # packed: BFD into rows of 32 (padding included), one forward and backward
    rows = pack_bfd([len(d[0]) for d in docs], 32)
    batch = collate_rows([[docs[i] for i in r] for r in rows], 32, pad_id=0)
    assert batch.input_ids.shape[0] < len(docs) and (batch.input_ids == 0).any()  # packed, with padding
    model.zero_grad()
    loss = model(batch.input_ids, **batch.model_kwargs(), reduction="sum")
    loss.backward()
    assert batch.num_loss_tokens == sum(int(t[1:].sum()) for _, t in docs)
    assert abs(loss.item() - ref_loss) <= 1e-5 * abs(ref_loss)
    for k, p in params.items():
        # float32 sums in another order (one batch vs eight): allow 1e-5 of the gradient's largest entry
        err, scale = (p.grad - ref_grads[k]).abs().max().item(), ref_grads[k].abs().max().item()
        assert scale > 0 and err <= 1e-5 * scale, f"{k}: max error {err:.3g} vs largest gradient {scale:.3g}"


def _cudnn_ok() -> bool:
    from chronicals.ops import attention_cudnn

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and attention_cudnn.available()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernels need CUDA")
@pytest.mark.parametrize("varlen", ["flash", "cudnn"])
def test_packed_training_step_on_cuda_matches_float32(varlen):
    """bf16, the Triton path, packed rows through each varlen kernel (model.attention): loss and every gradient
    within bf16 error of the float32 masked-SDPA model on the same batch; cudnn no worse than 1.5x flash's error."""
    if varlen == "cudnn" and not _cudnn_ok():
        pytest.skip("needs nvidia-cudnn-frontend, cuDNN >= 9.6 and a Hopper GPU")
    rng = np.random.default_rng(1)
    docs = [(rng.integers(1, 97, n), np.ones(n, bool)) for n in [150, 40, 300, 90, 200, 250, 17, 130]]
    rows = pack_bfd([len(d[0]) for d in docs], 512)
    batch = collate_rows([[docs[i] for i in r] for r in rows], 512, pad_id=0).to("cuda")
    hf = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)

    def step(dtype, impl, kernel):
        model = CausalLM(ModelConfig.from_hf_dict(hf.to_dict()), impl=impl).init_weights(std=0.05, seed=0)
        model = model.to(dtype).cuda()
        model.opts.attention = kernel
        loss = model(batch.input_ids, **batch.model_kwargs(), reduction="mean")
        loss.backward()
        return loss.item(), {k: p.grad.double() for k, p in model.named_parameters()}

    ref_loss, ref = step(torch.float32, "torch", "auto")
    errs = {}
    for kernel in ("flash", varlen):
        loss, grads = step(torch.bfloat16, "triton", kernel)
        assert abs(loss - ref_loss) <= 2e-2 * abs(ref_loss)
        errs[kernel] = max(((grads[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref)
    assert errs["flash"] < 0.1 and errs[varlen] <= 1.5 * errs["flash"] + 1e-3, errs


def test_the_last_token_of_each_packed_document_predicts_nothing():
    labels = torch.tensor([[10, 11, 12, 20, 21, 22]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert shift_labels_per_document(labels, pos).tolist() == [[11, 12, -100, 21, 22, -100]]


def test_a_packed_rows_loss_with_labels_is_the_sum_of_its_documents_losses():
    model = CausalLM(_cfg()).init_weights(seed=0).eval()
    a, b = torch.tensor([[3, 4, 5, 6]]), torch.tensor([[7, 8, 9]])
    ids = torch.cat([a, b], 1)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    with torch.no_grad():
        packed = model(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=4, labels=ids, reduction="sum")
        apart = model(a, labels=a, reduction="sum") + model(b, labels=b, reduction="sum")
    torch.testing.assert_close(packed, apart, rtol=1e-5, atol=1e-5)


def test_restarting_position_ids_without_cu_seqlens_are_packed_documents():
    """position_ids restarting at 0 inside a row, and no cu_seqlens: the loss was split per document while
    attention crossed them (logits 80% off per-document ones; an architecture walk). Now they are documents, as
    transformers 5 reads them: logits equal each document's own, over two rows; rows that do not restart stay
    plain causal rows (positions need not start at 0)."""
    model = tiny_model().eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 97, (2, 20), generator=gen)
    pos = torch.stack([torch.cat([torch.arange(8), torch.arange(12)]), torch.cat([torch.arange(5), torch.arange(15)])])
    got = model(ids, position_ids=pos)
    for row, cut in ((0, 8), (1, 5)):
        want = torch.cat([model(ids[row:row + 1, :cut]), model(ids[row:row + 1, cut:])], dim=1)
        torch.testing.assert_close(got[row:row + 1], want, rtol=1e-5, atol=1e-5)
    shifted = torch.arange(3, 23).expand(2, 20)  # no restart: one document a row, positions from 3
    plain = model(ids, position_ids=shifted)
    cu = torch.tensor([0, 20, 40], dtype=torch.int32)
    torch.testing.assert_close(plain, model(ids, position_ids=shifted, cu_seqlens=cu, max_seqlen=20))


def test_restarting_position_ids_of_one_row_mark_every_rows_documents():
    """position_ids (1, S) serve every row alike; read as documents unexpanded, cu_seqlens covered row 0's tokens
    only and rows 1.. attended across the documents (logits 0.24 off; a Python-API walk)."""
    model = tiny_model().eval()
    ids = torch.randint(1, 97, (3, 10), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        got = model(ids, position_ids=pos)
        want = torch.cat([model(ids[:, :5]), model(ids[:, 5:])], dim=1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(ids, position_ids=pos, labels=ids),
                                   model(ids, position_ids=pos.expand(3, -1), labels=ids))


def test_cu_seqlens_without_position_ids_is_refused():
    """Packed rows need their per-document positions: without them RoPE ran 0..S-1 across the documents while the
    attention was cut per document, logits silently wrong (untested: a mutation walk)."""
    model = tiny_model().eval()
    ids = torch.randint(1, 97, (1, 10), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="need position_ids"):
        model(ids, cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32), max_seqlen=6)
