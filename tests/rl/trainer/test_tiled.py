"""Tiled logprobs (rl/trainer/tiled.py) against the full-logits functions they replace (`token_logprobs`,
`packed_logprobs`): the same values and the same gradients (hidden states and head weights, tied to the
input embeddings as in SmolLM2) to float round-off, with tiles that do not divide the tokens; the head-input
capture of a real transformers model gives its logits back; and the reason DeepSpeed's tiled compute is not
used holds in the installed version."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from rl.trainer.batch import token_logprobs
from rl.trainer.packing import logit_nodes, pack_prefixes, packed_logprobs
from rl.trainer.tiled import chunked_logprobs, head_inputs, tiled_packed_logprobs, tiled_token_logprobs, tiling_refusal


def _head(V: int = 97, D: int = 16, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    head = nn.Linear(D, V, bias=False)
    nn.init.normal_(head.weight, std=0.5)
    return head


def _grads(fn, head, h):
    h = h.detach().clone().requires_grad_(True)
    head.zero_grad()
    out = fn(head, h)
    g_out = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
    (out * g_out).sum().backward()
    return out.detach(), h.grad.clone(), head.weight.grad.clone()


@pytest.mark.parametrize("tile", [0, 1, 7, 64, 1000])
def test_tiled_token_logprobs_equal_the_full_logits_ones(tile):
    head = _head()
    B, T, W, D = 3, 40, 25, 16
    ids = torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(2))
    h = torch.randn(B, W, D, generator=torch.Generator().manual_seed(3))
    ref = _grads(lambda m, x: token_logprobs(m(x), ids), head, h)
    got = _grads(lambda m, x: tiled_token_logprobs(m, x, ids, tile), head, h)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    assert (got[0][:, : T - W + 1] == 0).all() and (got[0][:, T - W + 1:] < 0).all()


def test_tiled_packed_logprobs_equal_the_full_logits_ones():
    torch.manual_seed(4)
    prompt = torch.randint(3, 97, (20,))
    rows = [torch.cat([prompt, torch.randint(3, 97, (n,))]) for n in (5, 9, 3, 7)]
    B, T = len(rows), max(len(r) for r in rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    loss = torch.zeros(B, T)
    for b, r in enumerate(rows):
        ids[b, : len(r)], attn[b, : len(r)], loss[b, 20: len(r)] = r, 1, 1.0
    pack = pack_prefixes(ids, attn, torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long))
    keep_K, rows_M = logit_nodes(pack, loss)
    head = _head()
    h = torch.randn(pack.shape[0], keep_K.numel(), 16)
    ref = _grads(lambda m, x: packed_logprobs(m(x), pack, keep_K, rows_M, ids, loss), head, h)
    got = _grads(lambda m, x: tiled_packed_logprobs(m, x, rows_M, ids, loss, 5), head, h)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    assert (got[0][loss > 0] < 0).all() and (got[0][loss == 0] == 0).all()


def test_tied_head_gets_both_gradients():
    """Tied weights (SmolLM2): the head's gradient from the tiles adds to the embedding's, as untiled."""
    emb = nn.Embedding(50, 8)
    head = nn.Linear(8, 50, bias=False)
    head.weight = emb.weight
    ids = torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(5))

    def run(tile):
        emb.zero_grad()
        h = torch.tanh(emb(ids))
        lp = tiled_token_logprobs(head, h, ids, tile) if tile else token_logprobs(head(h), ids)
        lp.sum().backward()
        return lp.detach(), emb.weight.grad.clone()

    (a, ga), (b, gb) = run(0), run(4)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(ga, gb, atol=1e-5)


def test_no_graph_no_checkpoint():
    """Without a graph (old-policy and reference passes) the tiles run plainly and give the same values."""
    head = _head()
    h, y = torch.randn(50, 16), torch.randint(0, 97, (50,))
    with torch.no_grad():
        a = chunked_logprobs(head, h, y, 8)
    b = torch.log_softmax(head(h), -1).gather(-1, y[:, None]).squeeze(-1)
    assert not a.requires_grad and torch.allclose(a, b, atol=1e-6)


def test_head_inputs_of_a_transformers_model(tmp_path):
    """The captured hidden states through the model's own head are its logits; the forward's logits are cut to one row."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint

    init = build_tiny_checkpoint(tmp_path / "m", TinyModelSpec(kind="mixtral", num_experts=4, top_k=2))
    m = AutoModelForCausalLM.from_pretrained(str(init))
    ids = torch.randint(3, 500, (2, 12))
    with torch.no_grad():
        full = m(input_ids=ids, logits_to_keep=5).logits
        with head_inputs(m) as (head, seen):
            cut = m(input_ids=ids, logits_to_keep=5).logits
        assert cut.shape == (2, 1, full.shape[-1]) and seen[0].shape[:2] == (2, 5)
        assert torch.allclose(head(seen[0]), full, atol=1e-5)
        assert m(input_ids=ids, logits_to_keep=5).logits.shape == full.shape  # the hook is gone


def test_short_answers_cost_what_full_logits_cost(tmp_path):
    """What a step at 2k tokens pays for tiles (`trainer.logprob_tile_tokens`): with the loss window within one
    tile, the forward + backward of a transformers model and its tiled logprobs counts the FLOPs of the same
    model's full logits and `token_logprobs`, less one head row (the full logits carry a row no target reads, the
    cut forward one row without a backward). Past one tile, what is added is the head's forward over the window
    once more (the recompute), from counting: 2 x rows x hidden x vocab."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint

    m = AutoModelForCausalLM.from_pretrained(str(build_tiny_checkpoint(tmp_path / "m", TinyModelSpec(kind="mixtral"))))
    D, V = m.config.hidden_size, m.config.vocab_size
    ids = torch.randint(3, V, (1, 40), generator=torch.Generator().manual_seed(0))
    W = 17  # logits for the last 17 positions: 16 targets

    def flops(tile: int) -> int:
        m.zero_grad()
        with FlopCounterMode(display=False) as fc:
            if tile:
                with head_inputs(m) as (head, seen):
                    m(input_ids=ids, logits_to_keep=W)
                lp = tiled_token_logprobs(head, seen[0], ids, tile)
            else:
                lp = token_logprobs(m(input_ids=ids, logits_to_keep=W).logits, ids)
            lp.sum().backward()
        return fc.get_total_flops()

    full, one_tile, four_tiles = flops(0), flops(16), flops(4)
    row = 2 * D * V  # one head row's forward
    # full: 17 rows forward and backward (3 matmuls each); tiled: the cut row's forward (no loss reads it, so no
    # backward) and 16 rows forward and backward
    assert one_tile == full - 2 * row
    assert four_tiles == one_tile + 16 * row


def test_refusals_and_why_deepspeed_tiled_compute_does_not_fit():
    from types import SimpleNamespace

    assert tiling_refusal(SimpleNamespace(model_type="mixtral")) is None
    assert "final_logit_softcapping" in tiling_refusal(SimpleNamespace(model_type="gemma2", final_logit_softcapping=30.0))
    # DeepSpeed's SequenceTiledCompute views each tile's incoming gradient as the tile of its input: per-token
    # logprobs [B, t] of hidden states [B, t, D] cannot take that view (rl/trainer/tiled.py says why it is not used).
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    head = _head()
    h = torch.randn(1, 12, 16, requires_grad=True)
    y = torch.randint(0, 97, (1, 12))

    def fn(x, t):
        return torch.log_softmax(head(x), -1).gather(-1, t[..., None]).squeeze(-1)

    out = sequence_tiled_compute(fn, 12, 3, {"x": h, "t": y}, {}, "x", [head.weight], output_reduction=None)
    assert out.shape == (1, 12)
    with pytest.raises(RuntimeError):
        out.sum().backward()
