"""Shared-prefix packing (rl/trainer/packing.py): the tree layout against a slow reference built from
its definition (a node attends exactly the nodes whose token path is a prefix of its own), and the
packed forward of real transformers models (Llama, Mixtral, Qwen3-MoE) against the padded forward:
the same logprobs on every loss-masked target, the same gradients, and (MoE) the same routes."""
from __future__ import annotations

import pytest
import torch

from rl.trainer.packing import (logit_nodes, pack_prefixes, pack_routes, packed_logprobs, packed_values, should_pack,
                                unpack_routes)


def _grpo_batch(seed: int = 0, prompt: int = 14, vocab: int = 100):
    """Two groups of three rows: each group one prompt; generations of lengths 3..9 whose first tokens
    sometimes agree (shared generated nodes), right-padded. Returns ids, attention, loss mask, groups."""
    g = torch.Generator().manual_seed(seed)
    rows, groups, starts = [], [], []
    for grp in range(2):
        p = torch.randint(3, vocab, (prompt + grp,), generator=g).tolist()
        first = torch.randint(3, vocab, (2,), generator=g).tolist()
        for i in range(3):
            n = int(torch.randint(3, 10, (1,), generator=g))
            gen = torch.randint(3, vocab, (n,), generator=g).tolist()
            if i < 2:  # rows 0 and 1 of a group open with the same two generated tokens
                gen[:2] = first
            rows.append(p + gen)
            groups.append(grp)
            starts.append(len(p))
    B, T = len(rows), max(len(r) for r in rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    loss = torch.zeros(B, T)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.as_tensor(r)
        attn[b, : len(r)] = 1
        loss[b, starts[b]: len(r)] = 1.0
    return ids, attn, loss, torch.as_tensor(groups)


def _reference_mask(pack, ids_BT, attn_BT):
    """Node n may attend node m iff m's token path (tokens of its source row up to its depth) is a prefix of n's."""
    P, N = pack.shape
    T = ids_BT.shape[1]
    paths = {}
    for f, src in enumerate(pack.source_N.tolist()):
        if src >= 0:
            b, t = divmod(src, T)
            paths[f] = tuple(ids_BT[b, : t + 1].tolist())
    ref = torch.zeros(P, N, N, dtype=torch.bool)
    for p in range(P):
        for n in range(N):
            fn = p * N + n
            if fn not in paths:
                ref[p, n, n] = True
                continue
            for m in range(N):
                fm = p * N + m
                if fm in paths and paths[fn][: len(paths[fm])] == paths[fm]:
                    ref[p, n, m] = True
    return ref


def test_tree_layout_matches_its_definition():
    ids, attn, loss, groups = _grpo_batch()
    pack = pack_prefixes(ids, attn, groups, torch.zeros(6, dtype=torch.long))
    P, N = pack.shape
    assert P == 2
    # every real token maps to a node carrying that token at that depth
    real = attn > 0
    node = pack.node_BT[real]
    assert (pack.input_ids_PN.reshape(-1)[node] == ids[real]).all()
    cols = torch.arange(ids.shape[1]).expand_as(ids)[real]
    assert (pack.position_ids_PN.reshape(-1)[node] == cols).all()
    assert (pack.node_BT[~real] == -1).all()
    # one node per distinct (row prefix) in each group: the prompt once, the shared first tokens once
    distinct = len({(int(groups[b]), tuple(ids[b, : t + 1].tolist())) for b in range(6) for t in range(int(attn[b].sum()))})
    assert pack.real_tokens == distinct < int(attn.sum())
    assert torch.equal(pack.attention_mask_P1NN[:, 0], _reference_mask(pack, ids, attn))


def test_routes_round_trip_through_the_nodes():
    ids, attn, loss, groups = _grpo_batch(1)
    pack = pack_prefixes(ids, attn, groups, torch.zeros(6, dtype=torch.long))
    # routes that are a function of the context (as a router's are): equal on shared nodes
    ctx_hash = torch.zeros(ids.shape, dtype=torch.long)
    for b in range(6):
        for t in range(int(attn[b].sum())):
            ctx_hash[b, t] = hash(tuple(ids[b, : t + 1].tolist())) % 97
    routes = torch.where(attn[:, :, None, None] > 0, torch.stack([ctx_hash, ctx_hash + 1], -1)[:, :, None, :].repeat(1, 1, 3, 1), -1)
    packed = pack_routes(routes, pack)  # [P, N, L, k]
    back = unpack_routes(packed.reshape(-1, 3, 2).permute(1, 0, 2), pack)
    assert torch.equal(back, routes)


def test_should_pack_weighs_tokens_against_attention():
    # long shared prompt, short answers: 8 rows of 400 + 40 pack into ~720 nodes
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (1, 400)).repeat(8, 1)
    ids = torch.cat([ids, torch.randint(3, 100, (8, 40))], dim=1)
    ids[:, 400] = torch.arange(8) + 3  # the answers part at their first token
    attn = torch.ones_like(ids)
    pack = pack_prefixes(ids, attn, torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long))
    assert pack.real_tokens == 400 + 8 * 40
    assert should_pack(pack.shape, tuple(attn.shape), hidden_size=576)
    assert pack_prefixes(ids, attn, torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long), hidden_size=576) is not None
    # a short prompt and long, diverging episodes: one packed row of ~8 x 600 nodes attends far more than it saves
    ids2 = torch.cat([ids[:, :20], torch.randint(3, 100, (8, 600))], dim=1)
    attn2 = torch.ones_like(ids2)
    pack2 = pack_prefixes(ids2, attn2, torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long))
    assert not should_pack(pack2.shape, tuple(attn2.shape), hidden_size=576)
    # the gate in pack_prefixes gives the same answer before it builds any tensor
    assert pack_prefixes(ids2, attn2, torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long), hidden_size=576) is None


def _model(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=256, attn_implementation="sdpa")
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(intermediate_size=128, **common))
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **common))
    if kind == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(intermediate_size=128, **common))
    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(intermediate_size=128, **common))
    if kind == "olmoe":
        from transformers import OlmoeConfig, OlmoeForCausalLM

        return OlmoeForCausalLM(OlmoeConfig(intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                            **{k: v for k, v in common.items() if k != "head_dim"}))
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                              num_experts_per_tok=2, **common))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", "olmoe"])
def test_packed_forward_equals_padded_forward(kind):
    from model.families import RouterHooks, family_of

    ids, attn, loss, groups = _grpo_batch(2)
    m = _model(kind).float()
    from model.families import FAMILIES, packing_refusal

    assert packing_refusal(m.config) == "" and FAMILIES[kind].packs
    fam = family_of(m.config)
    hooks = RouterHooks(m, fam) if fam.replay == "hooks" else None
    w_BT = torch.rand(ids.shape, generator=torch.Generator().manual_seed(5)) * loss

    # the padded forward (the slow, obvious reference): full logits, per-position log-softmax
    out = m(input_ids=ids, attention_mask=attn)
    ref_lp = torch.zeros(ids.shape)
    logp = torch.log_softmax(out.logits.float(), -1)
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if loss[b, t] > 0:
                ref_lp[b, t] = logp[b, t - 1, ids[b, t]]
    (ref_lp * w_BT).sum().backward()
    ref_grads = [p.grad.clone() for p in m.parameters()]
    ref_routes = None
    if hooks is not None:
        r = hooks.used_LNK()  # [L, B*T, k]
        ref_routes = r.permute(1, 0, 2).reshape(ids.shape[0], ids.shape[1], r.shape[0], -1)
        hooks.clear()
    m.zero_grad()

    pack = pack_prefixes(ids, attn, groups, torch.zeros(6, dtype=torch.long))
    keep, rows = logit_nodes(pack, loss)
    out_p = m(input_ids=pack.input_ids_PN, attention_mask=pack.attention_mask_P1NN,
              position_ids=pack.position_ids_PN, logits_to_keep=keep)
    lp = packed_logprobs(out_p.logits, pack, keep, rows, ids, loss)
    assert torch.allclose(lp, ref_lp, atol=2e-5), float((lp - ref_lp).abs().max())
    assert (lp[loss == 0] == 0).all()
    (lp * w_BT).sum().backward()
    for g_ref, p in zip(ref_grads, m.parameters()):
        assert torch.allclose(p.grad, g_ref, atol=1e-5, rtol=1e-4), float((p.grad - g_ref).abs().max())
    if hooks is not None:
        got = unpack_routes(hooks.used_LNK(), pack)
        real = attn > 0
        assert torch.equal(got[real], ref_routes[real])
        # replaying the recorded routes through the packed layout is the recorded forward again
        hooks.clear()
        hooks.set_replay(pack_routes(ref_routes, pack).permute(2, 0, 1, 3).reshape(ref_routes.shape[2], -1, ref_routes.shape[3]))
        with torch.no_grad():
            out_r = m(input_ids=pack.input_ids_PN, attention_mask=pack.attention_mask_P1NN,
                      position_ids=pack.position_ids_PN, logits_to_keep=keep)
        hooks.set_replay(None)
        assert torch.allclose(packed_logprobs(out_r.logits, pack, keep, rows, ids, loss), ref_lp, atol=2e-5)


def test_every_family_marked_packs_is_checked_here():
    from model.families import FAMILIES

    marked = sorted(t for t, f in FAMILIES.items() if f.packs)
    checked = sorted(test_packed_forward_equals_padded_forward.pytestmark[0].args[1])
    assert marked == checked


def test_models_that_cannot_pack_say_why():
    from transformers import MistralConfig

    from model.families import packing_refusal
    from model.shipped import load_shipped_config

    assert "hybrid_moe" in packing_refusal(load_shipped_config("tiny"))
    assert "sliding_window=64" in packing_refusal(_model("qwen3_moe").config.__class__(sliding_window=64, use_sliding_window=True))
    cfg = _model("llama").config
    cfg._attn_implementation = "flash_attention_2"
    assert "ignores a custom 4D mask" in packing_refusal(cfg)
    assert "'mistral' is not one" in packing_refusal(MistralConfig())


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_packed_critic_values_and_gradients_equal_padded(kind):
    """The PPO critic (rl/trainer/critic.py `ValueModel`) on token trees: V(s_t) at every loss-masked position
    and the value head's and trunk's gradients equal the padded forward's."""
    from rl.trainer.critic import ValueModel

    ids, attn, loss, groups = _grpo_batch(4)
    vm = ValueModel(_model(kind).float())
    torch.nn.init.normal_(vm.head.weight, std=0.5)  # a zero head would make every value 0 and every trunk gradient 0
    w_BT = torch.rand(ids.shape, generator=torch.Generator().manual_seed(6)) * loss
    ref_v, tie = vm(ids, attn)
    ((ref_v * w_BT).sum() + tie).backward()
    ref_grads = [p.grad.clone() for p in vm.parameters()]
    vm.zero_grad()
    pack = pack_prefixes(ids, attn, groups, torch.zeros(6, dtype=torch.long))
    assert pack.real_tokens < int(attn.sum())  # the groups' prompts are shared
    v, tie = vm(ids, attn, pack=pack)
    mask = loss > 0
    assert torch.allclose(v[mask], ref_v[mask], atol=2e-5), float((v[mask] - ref_v[mask]).abs().max())
    ((v * w_BT).sum() + tie).backward()
    for g_ref, p in zip(ref_grads, vm.parameters()):
        assert torch.allclose(p.grad, g_ref, atol=1e-5, rtol=1e-4), float((p.grad - g_ref).abs().max())


def test_packed_values_reads_the_node_before_each_token():
    """packed_values against a loop from its definition: V at (b, t) is the value of the node of token t - 1."""
    ids, attn, _, groups = _grpo_batch(7)
    pack = pack_prefixes(ids, attn, groups, torch.zeros(6, dtype=torch.long))
    P, N = pack.shape
    v_PN = torch.randn(P, N)
    got = packed_values(v_PN, pack)
    B, T = ids.shape
    for b in range(B):
        for t in range(T):
            node = int(pack.node_BT[b, t - 1]) if t >= 1 else -1
            want = float(v_PN.reshape(-1)[node]) if node >= 0 else 0.0
            assert float(got[b, t]) == want, (b, t)
