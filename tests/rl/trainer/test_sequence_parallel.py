"""`trainer.sequence_parallel_size` (rl/trainer/ulysses.py, model/sequence_parallel.py): a sequence split over N = 2
trainer ranks gives the update of 1 rank, as tests/rl/trainer/test_group.py checks for data-parallel ranks.

Real DeepSpeed engines (gloo all_to_all / all_gather on CPU), real processes (torch.distributed is process-global):
one rank, then 2 ranks (one sequence-parallel group, data-parallel size 1) at ZeRO-1, 2 and 3 and with LoRA, and
4 ranks (two groups, data-parallel size 2, each group with the rows TrainerGroup deals it), on
- a tiny random Mixtral (2 heads, 1 KV head: DeepSpeed's `UlyssesSPAttentionHF` replicates the KV head), R2 replay;
- the tiny HybridMoe with its three gated delta layers and a sparse DSA layer (top-16 keys of ~90-token rows) with
  the indexer loss on, R2 replay;
each with a KL reference, tiled logprobs (tiles of 16 tokens) and activation checkpointing on (the recompute repeats
the collectives). Checked: the old-policy logprobs, recorded routes and reference logprobs of the loss tokens, the
weights after one AdamW step (to 1e-5; with LoRA the merged weights and the adapters), the grad norm, the step's
row and token counts. The first AdamW step moves each weight by about lr * sign(grad), so the weights mostly check
the gradients' signs and the grad norm (to 1e-4) their size."""
from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import dataclass

import pytest

from rl.http_io import free_port
from tests import REPO


def _episodes(vocab: int):
    """4 rows of 61-97 tokens (ragged: padded micro-batches, a row that ends inside the first rank's half)."""
    import random

    from rl.types import Episode

    rng = random.Random(3)
    eps = []
    for i, n in enumerate((97, 61, 88, 90)):
        ids = tuple(rng.randrange(11, vocab) for _ in range(n))
        mask = tuple([0] * 30 + [1] * (n - 30))
        eps.append(Episode(task_id=f"t{i // 2}", domain=("a", "b")[i % 2], group_id=f"g{i // 2}", token_ids=ids, loss_mask=mask,
                           rollout_logprobs=tuple(-3.0 * m for m in mask), messages=(), reward=float(i % 2)))
    return eps


@dataclass(frozen=True)
class Case:
    """One trainer a rank builds: a model at a ZeRO stage, fully fine-tuned or with LoRA adapters."""

    model: str  # "mixtral" (vocab 512) or "hybrid" (vocab 8192)
    zero_stage: int = 1
    lora_rank: int = 0

    @property
    def vocab(self) -> int:
        return 512 if self.model == "mixtral" else 8192


def _rank(rank: int, world: int, sp: int, port: int, tmp: str, cases: tuple[Case, ...], q) -> None:
    try:
        os.environ["JOINTRL_CACHE"] = str(REPO / ".cache")
        from rl.paths import setup_cache_env

        setup_cache_env()
        import torch

        from rl.algos import aggregation_weights
        from rl.objective import RLObjective
        from rl.trainer.batch import collate, micro_rows
        from rl.trainer.group import TrainerGroup
        from rl.trainer.lora import LoraSpec, adapter_state
        from rl.trainer.policy import PolicyTrainer, TrainerSpec

        torch.set_num_threads(1)
        out = {}
        for case in cases:
            init = f"{tmp}/{case.model}"
            spec = TrainerSpec(zero_stage=case.zero_stage, lr=1e-3, micro_batch_size=2, routing_replay="r2",
                               logprob_tile_tokens=16, activation_checkpointing="on", sequence_parallel_size=sp,
                               lora=LoraSpec(rank=case.lora_rank, targets=("attention", "experts")))
            tr = PolicyTrainer(init, spec, RLObjective(router_aux_coef=0.01, kl_coef=0.1), rank=rank, world_size=world,
                               master_port=port)
            tr.load_reference(init)
            full = collate(_episodes(case.vocab), [1.0, -1.0, 0.5, -0.5], domains=("a", "b"))
            w, _ = aggregation_weights("domain_token_mean", full.loss_mask_BT > 0, domain_ids_B=full.domain_ids_B)
            full = full.with_(loss_weights_BT=w)
            # This rank's rows as TrainerGroup deals them (a group's ranks share its rows) and the common
            # micro-batch count of the data-parallel groups.
            parts = TrainerGroup([None] * world, 2, None, sequence_parallel_size=sp)._rank_parts(full)
            rows, n_micro = parts[rank], max(len(micro_rows(full.select(p), 2)) for p in parts)
            batch = full.select(rows)
            old, routes = tr.compute_logprobs(batch, n_micro)
            ref = tr.reference_logprobs(batch)
            b = batch.with_(old_logprobs_BT=old, ref_logprobs_BT=ref, routed_experts_BTLK=routes, routes_from="trainer")
            m = tr.train_step(b, n_micro)
            weights = {n: t.numpy().copy() for n, t in tr.named_weights()}
            if case.lora_rank:  # the trained tensors themselves, besides the merged weights
                weights.update({n: t.numpy().copy() for n, t in adapter_state(tr.module, case.zero_stage == 3).items()})
            whole = [_whole(x, rows, full.num_seqs) for x in (old, ref, routes)]
            out[case] = dict(zip(("old", "ref", "routes"), whole), rows=rows, weights=weights, metrics=m)
            del tr
        q.put(((world, rank), out))
    except BaseException as e:  # pragma: no cover - reported by the parent
        import traceback

        q.put(((world, rank), {"error": traceback.format_exc() + repr(e)}))


def _whole(x_B, rows: list[int], B: int):
    """A rank's per-row result back at its rows of the B-row step batch (zeros elsewhere), as numpy (sent between
    processes by value, not by file descriptor)."""
    import torch

    return x_B.new_zeros(B, *x_B.shape[1:]).index_copy(0, torch.tensor(rows), x_B).numpy()


def _worlds(worlds: tuple[tuple[int, int, tuple[Case, ...]], ...], tmp: str) -> list[list[dict]]:
    """Each (world size, sequence_parallel_size, cases)'s ranks' results (rank order), the worlds run at the same
    time."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    for w, sp, cases in worlds:
        port = free_port()
        procs += [ctx.Process(target=_rank, args=(r, w, sp, port, tmp, cases, q)) for r in range(w)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for key, res in got.items():
        assert "error" not in res, f"rank {key[1]} of {key[0]}: {res['error']}"
    return [[got[(w, r)] for r in range(w)] for w, _, _ in worlds]


def _models(tmp_path) -> None:
    import torch

    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config
    from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint

    build_tiny_checkpoint(tmp_path / "mixtral", TinyModelSpec(kind="mixtral", num_experts=4, top_k=2))
    torch.manual_seed(0)
    cfg = load_shipped_config("tiny")
    cfg.index_topk, cfg.indexer_loss_coef = 16, 0.1  # sparse DSA and its indexer loss on these rows
    HybridMoeForCausalLM(cfg).save_pretrained(tmp_path / "hybrid")


def _same_update(a: dict, b: dict, what: str) -> float:
    """Assert that run `b` (a rank's rows) made the update of run `a` (1 rank, every row) to 1e-5: the logprobs
    and reference logprobs of the loss tokens, the recorded routes of the real tokens, the grad norm and the
    weights after the step. Returns the largest weight difference."""
    import numpy as np

    rows = b["rows"]
    mask = _episode_mask()[rows] > 0
    lp = max(float(np.abs(a[k][rows][mask] - b[k][rows][mask]).max()) for k in ("old", "ref"))
    assert len(rows) and lp <= 1e-5, f"{what}: logprobs differ from 1 rank's by {lp:.3g}"
    real = _episode_mask(attention=True)[rows] > 0
    assert np.array_equal(a["routes"][rows][real], b["routes"][rows][real]), what
    assert a["weights"].keys() == b["weights"].keys(), what
    worst = max(float(np.abs(a["weights"][n] - b["weights"][n]).max()) for n in a["weights"])
    print(f"{what}: max |logprobs - 1 rank's| = {lp:.3g}, |weights - 1 rank's| = {worst:.3g}; grad norm "
          f"{b['metrics']['train/grad_norm']:.6g} vs {a['metrics']['train/grad_norm']:.6g}")
    assert worst <= 1e-5, f"{what}: differs from 1 rank by {worst:.3g}"
    assert b["metrics"]["train/grad_norm"] == pytest.approx(a["metrics"]["train/grad_norm"], rel=1e-4), what
    return worst


def _episode_mask(attention: bool = False):
    """The loss mask (or attention mask) [4, T] of `_episodes`' batch (the same for both vocabularies)."""
    from rl.trainer.batch import collate

    batch = collate(_episodes(512), [0.0] * 4)
    return (batch.attention_mask_BT if attention else batch.loss_mask_BT).numpy()


@pytest.mark.slow
def test_two_ranks_sharing_each_sequence_compute_the_one_rank_update(tmp_path):
    """One group of 2 (data-parallel size 1): both models at ZeRO-1, the Mixtral at ZeRO-2, the HybridMoe at
    ZeRO-3 (parameters gathered by hooks inside the sharded forward, the backward and its recompute) and the
    Mixtral with LoRA adapters (q/k/v/o and the fused experts, rank 4), each against one rank."""
    _models(tmp_path)
    lora = Case("mixtral", lora_rank=4)
    base = (Case("mixtral"), Case("hybrid"), lora)
    cases = base + (Case("mixtral", zero_stage=2), Case("hybrid", zero_stage=3))
    (one,), two = _worlds(((1, 1, base), (2, 2, cases)), str(tmp_path))  # side by side: 3 processes
    for case in cases:
        a = one[Case(case.model, lora_rank=case.lora_rank)]
        for rank, b in enumerate(two):
            _same_update(a, b[case], f"{case} rank {rank} of 2 (sp 2)")
        # The group's first rank reports the rows and tokens; the other reports none (they are the same rows).
        assert two[0][case]["metrics"]["train/seqs"] == a["metrics"]["train/seqs"] == 4
        assert two[0][case]["metrics"]["train/tokens"] == a["metrics"]["train/tokens"]
        assert two[1][case]["metrics"]["train/seqs"] == 0.0
    hybrid = Case("hybrid")
    assert "dsa/indexer_loss" in one[hybrid]["metrics"]
    for case in (hybrid, Case("hybrid", zero_stage=3)):
        assert two[0][case]["metrics"]["dsa/indexer_loss"] == pytest.approx(one[hybrid]["metrics"]["dsa/indexer_loss"],
                                                                            rel=1e-4)


@pytest.mark.slow
def test_two_groups_of_two_ranks_compute_the_one_rank_update(tmp_path):
    """4 ranks, sequence_parallel_size 2: two groups (ranks 0-1 and 2-3), each with the 2 rows TrainerGroup deals
    it, data-parallel over the groups: the HybridMoe at ZeRO-1, the Mixtral at ZeRO-3 (its parameter gathers and
    head tiles span both groups, whose micro-batches differ in width)."""
    _models(tmp_path)
    cases = (Case("hybrid"), Case("mixtral", zero_stage=3))
    (one,), four = _worlds(((1, 1, (Case("hybrid"), Case("mixtral"))), (4, 2, cases)), str(tmp_path))  # 5 processes
    for case in cases:
        a = one[Case(case.model)]
        for rank, b in enumerate(four):
            _same_update(a, b[case], f"{case} rank {rank} of 4 (sp 2)")
        assert four[0][case]["rows"] == four[1][case]["rows"] and four[2][case]["rows"] == four[3][case]["rows"]
        assert sorted(four[0][case]["rows"] + four[2][case]["rows"]) == [0, 1, 2, 3]
        # Each group's first rank reports its rows and tokens, so the ranks' sums are the step's.
        for key in ("train/seqs", "train/tokens"):
            assert [four[r][case]["metrics"][key] > 0 for r in range(4)] == [True, False, True, False]
            assert sum(four[r][case]["metrics"][key] for r in range(4)) == a["metrics"][key]


def test_refusals_name_the_key_and_the_reason():
    from types import SimpleNamespace as C

    from model.shipped import load_shipped_config
    from rl.trainer.ulysses import model_refusal, size_problem

    assert size_problem(2, 3) == ("config key 'trainer.sequence_parallel_size': value 2 must divide trainer.num_workers=3 "
                                  "(each group of 2 ranks shares a sequence; the world_size / 2 groups split the batch)")
    assert "must be an integer >= 1" in size_problem(0, 2) and size_problem(2, 4) == "" and size_problem(1, 1) == ""
    mixtral = C(model_type="mixtral", num_attention_heads=2, num_key_value_heads=1, _attn_implementation="sdpa")
    assert model_refusal(mixtral, 2) == ""  # the KV head is replicated over the 2 ranks
    assert "3 attention heads" in model_refusal(C(model_type="llama", num_attention_heads=3, num_key_value_heads=3), 2)
    assert "'eager'" in model_refusal(C(model_type="qwen3", num_attention_heads=2, _attn_implementation="eager"), 2)
    assert "sliding_window=64" in model_refusal(C(model_type="qwen2", num_attention_heads=2, sliding_window=64), 2)
    for other in ("qwen3_next", "gpt_oss", "deepseek_v3"):
        assert "other than plain softmax attention" in model_refusal(C(model_type=other), 2)
    hybrid = load_shipped_config("tiny")  # gated delta layers with 2 value heads, a Gated DSA layer
    assert model_refusal(hybrid, 2) == "" and model_refusal(hybrid, 1) == ""
    assert "linear_num_value_heads=2 is not divisible by 4" in model_refusal(hybrid, 4)
    assert all(m.startswith("trainer.sequence_parallel_size=") for m in
               (model_refusal(hybrid, 4), model_refusal(C(model_type="gpt_oss"), 2)))


def test_a_group_shares_one_shard_and_micro_batches_pad_to_its_size():
    import torch

    from rl.trainer.batch import collate
    from rl.trainer.group import TrainerGroup
    from rl.trainer.ulysses import MIN_LOCAL, pad_columns, padded_width

    batch = collate(_episodes(512)[:3], [1.0, -1.0, 0.5], domains=("a", "b"))
    g = TrainerGroup([None] * 4, 1, None, sequence_parallel_size=2)  # world 4: 2 groups of 2 ranks
    parts = g._rank_parts(batch)
    assert parts[0] == parts[1] and parts[2] == parts[3] and sorted(parts[0] + parts[2]) == [0, 1, 2]
    assert TrainerGroup([None] * 2, 1, None, sequence_parallel_size=2)._rank_parts(batch) == [[0, 1, 2]] * 2  # dp 1
    assert padded_width(97, 2) == 98 and padded_width(5, 2) == 2 * MIN_LOCAL
    p = pad_columns(batch.with_(routed_experts_BTLK=torch.zeros(3, 97, 2, 1, dtype=torch.long)), 100)
    assert p.input_ids_BT.shape == (3, 100) and int(p.attention_mask_BT[:, 97:].sum()) == 0
    assert float(p.loss_mask_BT[:, 97:].abs().sum()) == 0 and bool((p.routed_experts_BTLK[:, 97:] == -1).all())
    assert torch.equal(p.input_ids_BT[:, :97], batch.input_ids_BT)


def test_the_config_key_is_checked_against_the_run_before_anything_starts(tmp_path):
    from rl.config import ConfigError, load_config
    from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint

    cfg = load_config(None, ["trainer.num_workers=2", "trainer.sequence_parallel_size=2", "model.arch=tiny"])
    assert cfg.trainer.sequence_parallel_size == 2 and load_config().trainer.sequence_parallel_size == 1
    cases = {
        "value 3 must divide trainer.num_workers=2": ["trainer.num_workers=2", "trainer.sequence_parallel_size=3"],
        "value 0 must be an integer >= 1": ["trainer.sequence_parallel_size=0"],
        "algorithm.advantage='gae': the critic does not split": ["trainer.num_workers=2", "trainer.sequence_parallel_size=2",
                                                                  "algorithm.advantage=gae"],
        "trainer.prefix_sharing='on'": ["trainer.num_workers=2", "trainer.sequence_parallel_size=2", "trainer.prefix_sharing=on"],
        "linear_num_value_heads=2 is not divisible by 4": ["trainer.num_workers=4", "trainer.sequence_parallel_size=4",
                                                           "model.arch=tiny"],
    }
    for why, overrides in cases.items():
        with pytest.raises(ConfigError, match="trainer.sequence_parallel_size") as e:
            load_config(None, overrides)
        assert why in str(e.value), str(e.value)
    odd = build_tiny_checkpoint(tmp_path / "q", TinyModelSpec(kind="qwen3_moe", num_heads=3, num_kv_heads=1))
    with pytest.raises(ConfigError, match="3 attention heads and 1 KV heads"):
        load_config(None, ["trainer.num_workers=2", "trainer.sequence_parallel_size=2", f"model.arch={odd}"])
