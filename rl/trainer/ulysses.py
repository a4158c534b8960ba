"""Ulysses sequence parallelism across trainer ranks (`trainer.sequence_parallel_size = N`).

Each micro-batch runs on N ranks at once, rank r holding positions [r * L, (r + 1) * L) of every row (the rows padded
on the right to N * L). Token-wise work (embeddings, MLPs, MoE experts, norms, the LM head) runs on the rank's L
positions; attention needs every position, so it is exchanged:

- HF families (Llama, Qwen2/3, Qwen3-MoE, Mixtral, OLMoE: plain softmax attention over `position_ids`): DeepSpeed's
  `UlyssesSPAttentionHF` (0.19.8, Arctic Long Sequence Training) wraps the model's attention function. One all-to-all
  gives each rank every position of H / N heads, the model's own attention (sdpa, flash) runs causal over the whole
  sequence, and a second all-to-all brings the outputs back to the rank's positions. Its `register_with_transformers`
  is not used: it replaces the attention function for the whole process, while the same process also runs the
  unsplit critic, so `install_hf_attention` wraps it to split only inside a sharded forward.
- The HybridMoe: its gated delta layers split by heads and its Gated DSA layers gather keys (model/sequence_parallel.py
  says how and why).

Rows and ranks: the N ranks of a sequence-parallel group (consecutive ranks) get the same shard of the step batch
(rl/trainer/group.py), so world_size / N groups split the batch as data-parallel ranks do. DeepSpeed's
`UlyssesSPDataLoaderAdapter` is not used: it shards batches from a DataLoader iterator, while here the driver deals
micro-batches to ranks and every rank of a group already holds its micro-batch (`shard_micro_batches` pads and cuts
it in place, no communication).

The loss stays global and exact: each rank computes the logprobs of the loss-masked targets its positions predict
(`sharded_logprobs`, through the LM head in tiles where rl/trainer/tiled.py allows), the group gathers them (and the
router logits and routes) into the whole [B, T], and every rank of the group evaluates the same objective on them.
The gather's backward keeps each rank's own slice of that gradient, so the group's ranks together back-propagate the
micro-batch's loss once; DeepSpeed then averages gradients over all world_size ranks, as `train_step`'s
`world_size x loss` expects. tests/rl/trainer/test_sequence_parallel.py: 1 rank vs 2 ranks with N = 2, the same update.

Refused, by name, before anything runs (`model_refusal`): HF families whose token mixers are not plain softmax
attention (Qwen3-Next's transformers delta layers, gpt-oss's sinks and sliding windows, DeepSeek-V3's MLA), eager
attention (a [T, T] mask per layer), sliding windows, head counts N does not divide; the HybridMoe with
`linear_num_value_heads` N does not divide. At run time: batches with images (`shard_micro_batches`). Shared-prefix
packing is off under N > 1 (its tree mask is a [T, T] mask, which Ulysses' causal attention drops).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Iterable, Iterator

import torch

from model.sequence_parallel import SequenceShard, current, gather, sharded
from rl.trainer.batch import TrainBatch
from rl.trainer.tiled import chunked_logprobs, head_inputs

KEY = "trainer.sequence_parallel_size"
# Positions per rank at least: the delta layers' conv reads K - 1 (3) positions of the previous rank.
MIN_LOCAL = 8
# HF families whose every layer is plain softmax attention over position ids (model/families.py marks them `packs`).
HF_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "olmoe")
# Step metrics summed over ranks: a group's ranks share one shard, so only its first rank reports them.
_SUMMED = ("train/seqs", "train/tokens", "train/forward_tokens", "train/micro_batches")


def size_problem(size: int, world_size: int) -> str:
    """Why `size` ranks per sequence cannot work with `world_size` trainer ranks ("" when they can)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return f"config key '{KEY}': value {size!r} must be an integer >= 1"
    if world_size % size:
        return (f"config key '{KEY}': value {size} must divide trainer.num_workers={world_size} (each group of "
                f"{size} ranks shares a sequence; the world_size / {size} groups split the batch)")
    return ""


def model_refusal(config, size: int) -> str:
    """Why a model with this config cannot be trained with `size` ranks per sequence ("" when it can)."""
    if size <= 1:
        return ""
    mt = getattr(config, "model_type", None)
    if mt == "hybrid_moe":
        if "linear_attention" in (getattr(config, "layer_types", None) or ()) and config.linear_num_value_heads % size:
            return (f"{KEY}={size}: the HybridMoe's gated delta layers split by value heads, and "
                    f"linear_num_value_heads={config.linear_num_value_heads} is not divisible by {size}")
        return ""
    if mt not in HF_FAMILIES:
        return (f"{KEY}={size}: model_type {mt!r} has token mixers other than plain softmax attention (Ulysses splits "
                f"attention heads only); supported: hybrid_moe, {', '.join(HF_FAMILIES)}")
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if "eager" in impl:
        return f"{KEY}={size}: attention implementation {impl!r} needs a [T, T] mask per layer; load the model with sdpa"
    H = int(config.num_attention_heads)
    Hkv = int(getattr(config, "num_key_value_heads", None) or H)
    if H % size or not (Hkv % size == 0 or size % Hkv == 0):
        return (f"{KEY}={size}: {H} attention heads and {Hkv} KV heads; Ulysses needs the heads divisible by {size} "
                f"and the KV heads divisible by it or dividing it")
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window:
        return f"{KEY}={size}: sliding-window attention (sliding_window={window}) is not kept by Ulysses' causal attention"
    return ""


def run_config_problem(cfg) -> str:
    """Why a run config cannot train with its `trainer.sequence_parallel_size` ("" when it can), before anything
    starts: the size against trainer.num_workers, the parts that do not split (the critic, packing, images), and
    the model where its config can be read here (a checkpoint directory or a shipped config; a model pulled by
    name is checked when the trainer loads it)."""
    size = cfg.trainer.sequence_parallel_size
    problem = size_problem(size, cfg.trainer.num_workers)
    if problem or size == 1:
        return problem
    if cfg.algorithm.advantage == "gae":
        return (f"config key '{KEY}': value {size} with algorithm.advantage='gae': the critic does not split sequences "
                "(allowed: 1, or another advantage)")
    if cfg.trainer.prefix_sharing == "on":
        return (f"config key '{KEY}': value {size} with trainer.prefix_sharing='on': a packed forward's tree mask is a "
                "[T, T] mask, which sequence-parallel attention does not take ('auto' turns packing off)")
    if cfg.rollout.max_images_per_prompt:
        return (f"config key '{KEY}': value {size} with rollout.max_images_per_prompt="
                f"{cfg.rollout.max_images_per_prompt}: a sharded forward takes text only")
    for key, value in (("model.arch", cfg.model.arch), ("model.reference", cfg.model.reference)):
        config = _model_config(value)
        problem = model_refusal(config, size) if config is not None else ""
        if problem:
            return f"config key '{KEY}' with {key}={value!r}: {problem}"
    return ""


def _model_config(value: str):
    """The model config behind a `model.arch` / `model.reference` value, where it can be read without loading
    weights or the network (None otherwise)."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    path = Path(value) / "config.json"
    if path.is_file():
        try:
            return SimpleNamespace(**json.loads(path.read_text()))
        except (OSError, ValueError):
            return None  # reported by the model-family check
    from model.shipped import SHIPPED_CONFIGS, load_shipped_config

    return load_shipped_config(value) if value in SHIPPED_CONFIGS else None  # else 'initial' or a hub name


@dataclass(frozen=True)
class SequenceParallel:
    """This trainer rank's sequence-parallel group."""

    size: int
    rank: int  # index in the group; 0 reports the group's summed metrics
    group: Any


_GROUPS: dict[tuple[int, int, int], Any] = {}


def setup(size: int, rank: int, world_size: int) -> SequenceParallel | None:
    """The group of `size` consecutive ranks holding `rank` (None for size 1). Every rank creates every group, in the
    same order (torch.distributed.new_group is collective over the world)."""
    problem = size_problem(size, world_size)
    if problem:
        raise ValueError(problem)
    if size == 1:
        return None
    import torch.distributed as dist

    key = (world_size, size, rank)
    if key not in _GROUPS:
        for g in range(world_size // size):
            ranks = list(range(g * size, (g + 1) * size))
            group = dist.new_group(ranks)
            if rank in ranks:
                _GROUPS[key] = group
    return SequenceParallel(size, rank % size, _GROUPS[key])


def prepare_model(config, sp: SequenceParallel | None, prefix_sharing: str, role: str) -> None:
    """A model the trainer loads (`role`: policy, reference) under sequence parallelism: it must split
    (`model_refusal`), packing must not be forced on, and its HF attention function is wrapped to split inside
    sharded forwards. Nothing without `sp`."""
    if sp is None:
        return
    problem = model_refusal(config, sp.size)
    if problem:
        raise ValueError(f"the {role}: {problem}")
    if prefix_sharing == "on":
        raise ValueError(f"trainer.prefix_sharing='on' with {KEY}={sp.size}: a packed forward's tree mask is a [T, T] "
                         "mask, which sequence-parallel attention does not take; use 'auto' or 'off'")
    install_hf_attention(config)


# ---------------------------------------------------------------------------- HF attention
_CORE: dict[str, Callable] = {}
_ULYSSES: dict[tuple, Any] = {}


def install_hf_attention(config) -> None:
    """Wrap the attention function the model uses (by its `_attn_implementation`) so that inside a sharded forward
    it runs through DeepSpeed's `UlyssesSPAttentionHF`, and outside it unchanged. Once per implementation."""
    if getattr(config, "model_type", None) == "hybrid_moe":
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl in _CORE:
        return
    core = _CORE[impl] = ALL_ATTENTION_FUNCTIONS[impl]

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        shard = current()
        if shard is None:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        uattn = _ulysses(core, impl, shard, query, key)
        groups = getattr(module, "num_key_value_groups", None)
        try:  # the mask was built for L positions; causal attention over the gathered N * L replaces it
            return uattn(module, query, key, value, None, *args, **kwargs)
        finally:  # DeepSpeed rewrites it when it replicates KV heads (N > KV heads); the unsplit forward needs it back
            if groups is not None:
                module.num_key_value_groups = groups

    ALL_ATTENTION_FUNCTIONS[impl] = attention


def _ulysses(core, impl: str, shard: SequenceShard, query_BHLD: torch.Tensor, key_BHLD: torch.Tensor):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    B, H, _, D = query_BHLD.shape
    spec = (impl, id(shard.group), B, H, int(key_BHLD.shape[1]), D)
    if spec not in _ULYSSES:
        u = UlyssesSPAttentionHF(attn=core, batch_size=B, attn_head_count=H, attn_head_size=D,
                                 kv_head_count=int(key_BHLD.shape[1]), num_hidden_layers=1,
                                 process_group=shard.group, seq_length_is_variable=True)
        u.core_attn_implementation = impl
        _ULYSSES[spec] = u
    return _ULYSSES[spec]


# ---------------------------------------------------------------------------- micro-batches
def padded_width(T: int, size: int) -> int:
    return size * max(-(-T // size), MIN_LOCAL)


def pad_columns(mb: TrainBatch, width: int) -> TrainBatch:
    """`mb` with padding columns on the right up to `width` (token 0, no attention, no loss, route -1)."""
    T = mb.input_ids_BT.shape[1]
    if width == T:
        return mb
    kw = {}
    for f in fields(mb):
        x = getattr(mb, f.name)
        if f.name.endswith(("_BT", "_BTLK")) and isinstance(x, torch.Tensor):
            fill = -1 if f.name == "routed_experts_BTLK" else 0
            kw[f.name] = torch.cat([x, x.new_full((x.shape[0], width - T, *x.shape[2:]), fill)], dim=1)
    return replace(mb, **kw)


def shard_micro_batches(items: Iterable[tuple[TrainBatch, bool]], sp: SequenceParallel) -> Iterator[tuple[TrainBatch, bool]]:
    """The micro-batches padded to N * L columns, each yielded inside its `SequenceShard` (model/sequence_parallel.py):
    the caller's forward, backward and any recompute of checkpointed layers run as this rank's part."""
    for mb, padding in items:
        if mb.image_mask_BT is not None and bool(mb.image_mask_BT.any()):
            raise ValueError(f"{KEY}={sp.size}: a sharded forward takes text only, and this batch carries images "
                             "(set it to 1 for image tasks)")
        mb = pad_columns(mb, padded_width(mb.input_ids_BT.shape[1], sp.size))
        attn = mb.attention_mask_BT
        shard = SequenceShard(sp.group, sp.rank, sp.size, attn.shape[1] // sp.size, attn.shape[0],
                              None if bool(attn.all()) else attn)
        with sharded(shard):
            yield mb, padding


# ---------------------------------------------------------------------------- forward and gathers
def sharded_logprobs(run: Callable, m: torch.nn.Module, mb: TrainBatch, shard: SequenceShard,
                     replay_BTLK: torch.Tensor | None, router_logits: bool, module: torch.nn.Module | None,
                     tile: int) -> tuple[Any, torch.Tensor]:
    """This rank's forward over its positions, and the logprobs [B, T] of the micro-batch's loss-masked targets
    (0 elsewhere), gathered from the group's ranks: the same tensor on each. `run` is the trainer's model call
    (`PolicyTrainer._run`)."""
    ids, lmask = mb.input_ids_BT, mb.loss_mask_BT
    B, T = ids.shape
    s0, s1 = shard.start, shard.stop
    L = s1 - s0
    kw = dict(input_ids=ids[:, s0:s1], attention_mask=mb.attention_mask_BT[:, s0:s1],
              position_ids=torch.arange(s0, s1, device=ids.device)[None].expand(B, L), logits_to_keep=0)
    replay = replay_BTLK[:, s0:s1] if replay_BTLK is not None else None
    with head_inputs(m) if tile else nullcontext((None, None)) as (head, hidden):
        out = run(kw, replay_BTLK=replay, router_logits=router_logits, module=module)
    # Position s0 + j predicts token s0 + j + 1: the rank's targets are [s0 + 1, s1 + 1), cut at T.
    n = min(s1 + 1, T) - (s0 + 1)
    want_BL = torch.zeros(B, L, dtype=torch.bool, device=ids.device)
    want_BL[:, :n] = lmask[:, s0 + 1:s0 + 1 + n] > 0
    tgt_BL = torch.zeros(B, L, dtype=ids.dtype, device=ids.device)
    tgt_BL[:, :n] = ids[:, s0 + 1:s0 + 1 + n]
    b_M, j_M = torch.nonzero(want_BL, as_tuple=True)
    if tile:
        vals_M = chunked_logprobs(head, hidden[0][b_M, j_M], tgt_BL[b_M, j_M], tile)
    else:
        vals_M = torch.log_softmax(out.logits[b_M, j_M].float(), dim=-1).gather(-1, tgt_BL[b_M, j_M, None]).squeeze(-1)
    pred_BL = torch.zeros(B, L, dtype=torch.float32, device=ids.device).index_put((b_M, j_M), vals_M)
    pred_BT = gather(pred_BL, 1, shard, replicated=True)  # pred[:, t] = log p(x_{t+1} | x_<=t)
    return out, torch.cat([pred_BT.new_zeros(B, 1), pred_BT[:, :-1]], dim=1)


def gather_tokens(x: torch.Tensor | None, token_dim: int, replicated: bool = True) -> torch.Tensor | None:
    """A per-token tensor of this rank's forward (token_dim indexes its B * L rows, batch-major) as the whole
    micro-batch's B * N * L rows, inside a sharded forward; unchanged outside one."""
    shard = current()
    if shard is None or x is None:
        return x
    B, shape = shard.rows, x.shape
    x_BL = x.reshape(*shape[:token_dim], B, shape[token_dim] // B, *shape[token_dim + 1:])
    full = gather(x_BL, token_dim + 1, shard, replicated=replicated)
    return full.reshape(*shape[:token_dim], -1, *shape[token_dim + 1:])


def group_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of a (detached) tensor over the sequence-parallel group inside a sharded forward; itself outside one."""
    shard = current()
    if shard is None:
        return x.detach()
    import torch.distributed as dist

    x = x.detach().clone()
    dist.all_reduce(x, group=shard.group)
    return x


def follower_metrics(metrics: dict[str, float], sp: SequenceParallel | None) -> dict[str, float]:
    """A step's metrics as this rank reports them: a group's ranks besides its first report no rows or tokens of
    their own (they share the first's), so the group's sums count each row once."""
    if sp is None or sp.rank == 0:
        return metrics
    return {k: (0.0 if k in _SUMMED else v) for k, v in metrics.items()}
