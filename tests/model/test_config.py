"""Config: layer schedule, validation errors, shipped configs (sizes vLLM-CPU can serve, parameter budgets), and
the full-scale parameter count computed analytically (checked first against instantiated models)."""
from __future__ import annotations

import pytest
import torch

import model
from model import HybridMoeConfig, HybridMoeForCausalLM
from model.configuration import default_layer_types
from model.param_count import count_parameters


def test_default_schedule_is_3_delta_to_1_dsa_and_93_layers_give_69_plus_24():
    assert default_layer_types(4) == ["linear_attention"] * 3 + ["indexed_attention"]
    t = default_layer_types(93)
    assert t.count("linear_attention") == 69 and t.count("indexed_attention") == 24
    assert t[:4] == ["linear_attention"] * 3 + ["indexed_attention"]


def test_transformers_accepts_the_layer_type_names():
    from transformers.configuration_utils import ALLOWED_LAYER_TYPES
    assert {"linear_attention", "indexed_attention"} <= set(ALLOWED_LAYER_TYPES)
    HybridMoeConfig().validate_layer_type()


@pytest.mark.parametrize("bad, match", [
    (dict(layer_types=["linear_attention"] * 3), "layer_types"),
    (dict(layer_types=["linear_attention"] * 3 + ["full_attention"]), r"layer_types\[3\]"),
    (dict(num_key_value_heads=3, num_attention_heads=4), "num_key_value_heads"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(indexer_loss_mode="kl"), "indexer_loss_mode"),
    (dict(index_topk=0), "index_topk"),
])
def test_bad_config_raises_naming_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        HybridMoeConfig(**bad)


@pytest.mark.parametrize("name", ["tiny", "small", "full"])
def test_shipped_configs_have_vllm_cpu_head_sizes(name):
    c = model.load_shipped_config(name)
    assert c.model_type == "hybrid_moe"
    assert c.vllm_cpu_servable_sizes(), (c.head_dim, c.linear_key_head_dim, c.linear_value_head_dim)
    assert c.pad_token_id == 0 and c.eos_token_id == 1 and c.image_token_id == 10
    if name != "full":
        assert c.vocab_size == 8192
        assert c.index_topk >= c.max_position_embeddings  # vLLM-CPU serves these DSA layers as dense attention


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_analytic_count_matches_instantiated_model(name):
    c = model.load_shipped_config(name)
    torch.manual_seed(0)
    with torch.device("meta"):
        m = HybridMoeForCausalLM(c)
    real = sum(p.numel() for p in m.parameters())
    pc = count_parameters(c)
    assert pc.total == real
    experts = sum(p.numel() for n, p in m.named_parameters() if ".mlp.experts." in n)
    patch = sum(p.numel() for n, p in m.named_parameters() if "patch_embed" in n)
    per_layer_active = c.num_experts_per_tok / c.num_experts
    assert pc.active == real - experts + int(experts * per_layer_active) - patch


def test_shipped_sizes_are_in_budget():
    tiny, small = (count_parameters(model.load_shipped_config(n)) for n in ("tiny", "small"))
    assert 1e6 <= tiny.total <= 5e6, tiny.total
    assert 50e6 <= small.total <= 100e6, small.total


def test_full_scale_lands_near_2_8T_total_104B_active():
    c = model.load_shipped_config("full")
    assert c.num_hidden_layers == 93
    assert c.layer_types.count("linear_attention") == 69 and c.layer_types.count("indexed_attention") == 24
    assert c.index_topk == 2048
    pc = count_parameters(c)
    assert abs(pc.total / 2.8e12 - 1) < 0.02, pc.total
    assert abs(pc.active / 104e9 - 1) < 0.02, pc.active
    # the routed experts are where the parameters are: >98 % of the total
    assert pc.breakdown_total["routed_experts"] / pc.total > 0.98


def test_unknown_shipped_config_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="tiny"):
        model.load_shipped_config("huge")
