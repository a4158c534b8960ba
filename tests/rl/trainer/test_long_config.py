"""The long-sequence config keys are checked before anything starts, and the step metrics they are judged by
combine over ranks as documented: `train/peak_rss_gb` the largest rank's, `train/tokens_per_s` the step's tokens
over its slowest rank's time."""
from __future__ import annotations

import pytest

from rl.config import ConfigError, load_config
from rl.trainer.engine import peak_rss_gb, reset_peak_rss
from rl.trainer.group import reduce_rank_metrics


def test_long_sequence_keys():
    cfg = load_config(None, ["trainer.logprob_tile_tokens=2048", "trainer.activation_checkpointing=on",
                             "trainer.max_tokens_per_micro_batch=32768"])
    t = cfg.trainer
    assert (t.logprob_tile_tokens, t.activation_checkpointing, t.max_tokens_per_micro_batch) == (2048, "on", 32768)
    assert load_config().trainer.activation_checkpointing == "auto"
    with pytest.raises(ConfigError, match="'trainer.activation_checkpointing'.*'off', 'on', 'auto'"):
        load_config(None, ["trainer.activation_checkpointing=sometimes"])
    with pytest.raises(ConfigError, match="'trainer.logprob_tile_tokens': value -1 must be >= 0"):
        load_config(None, ["trainer.logprob_tile_tokens=-1"])
    with pytest.raises(ConfigError, match="'trainer.max_tokens_per_micro_batch': value -5 must be >= 0"):
        load_config(None, ["trainer.max_tokens_per_micro_batch=-5"])
    # trainer.sequence_parallel_size: tests/rl/trainer/test_sequence_parallel.py


def test_trainer_spec_modes_are_checked():
    from types import SimpleNamespace

    from rl.trainer import checkpointing

    with pytest.raises(ValueError, match="trainer.activation_checkpointing='x'"):
        checkpointing.check_mode("x")
    small = SimpleNamespace(hidden_size=576, num_hidden_layers=30)  # SmolLM2-135M's trunk
    assert not checkpointing.wanted("auto", 2048, small) and checkpointing.wanted("auto", 8192, small)
    assert checkpointing.wanted("on", 1, small) and not checkpointing.wanted("off", 10**6, small)


def test_step_metrics_over_ranks():
    ranks = [{"train/tokens": 3000.0, "train/step_s": 2.0, "train/tokens_per_s": 1500.0, "train/peak_rss_gb": 7.5, "train/seqs": 3.0},
             {"train/tokens": 1000.0, "train/step_s": 4.0, "train/tokens_per_s": 250.0, "train/peak_rss_gb": 9.0, "train/seqs": 1.0}]
    m = reduce_rank_metrics(ranks).as_metrics()
    assert m["train/peak_rss_gb"] == 9.0
    assert m["train/tokens_per_s"] == pytest.approx(4000.0 / 4.0)


_PEAK_PROBE = """
import torch
from rl.trainer.engine import peak_rss_gb, reset_peak_rss
reset_peak_rss()
before = peak_rss_gb()
x = torch.ones(64 * 2**20 // 4 * 8)  # 512 MiB, touched
grown = peak_rss_gb()
del x
reset_peak_rss()
print(before, grown, peak_rss_gb())
"""


def test_peak_rss_follows_an_allocation_and_resets():
    # In a fresh interpreter: inside the suite's process, after other tests, the peak once stayed where it
    # was while the 512 MiB were touched (a fast-subset run); the measured process must have no history.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PEAK_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, grown, after = map(float, out.stdout.split()[-3:])
    assert grown - before > 0.4 and after < grown - 0.3


def test_hybrid_moe_checkpointed_by_transformers_counts_expert_load_once():
    """`gradient_checkpointing_enable` on the HybridMoe (what the bench's bare floor and any HF trainer call):
    the backward's recompute of each layer does not add its tokens to the expert-load counter again."""
    import torch

    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config

    torch.manual_seed(0)
    ids = torch.randint(11, 8000, (2, 24))
    loads = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        m = HybridMoeForCausalLM(load_shipped_config("tiny")).train()
        if ckpt:
            m.gradient_checkpointing_enable()
        m(input_ids=ids).logits.square().mean().backward()
        loads[ckpt] = m.accumulated_expert_load().clone()
    cfg = load_shipped_config("tiny")
    assert float(loads[False].sum()) == ids.numel() * cfg.num_experts_per_tok * len(cfg.moe_layer_indices)
    assert torch.equal(loads[True], loads[False])
