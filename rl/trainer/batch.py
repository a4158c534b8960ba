"""Collate episodes into padded training tensors.

Token convention: position t of `input_ids_BT` is predicted by the logits at t-1, so every
per-token quantity here (loss mask, rollout logprobs, advantages) is indexed by the *target*
token and the first column is never trained. Padding is on the right with `pad_id`; padded
positions have loss_mask 0 and attention_mask 0. This module does not compute advantages: it
receives one scalar (outcome) advantage per episode, or a per-token tensor, from rl.algos.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from rl.types import Episode, TokenImage, segments_of


@dataclass(frozen=True)
class TrainBatch:
    input_ids_BT: torch.Tensor  # long
    attention_mask_BT: torch.Tensor  # long, 1 on real tokens
    loss_mask_BT: torch.Tensor  # float, 1 on policy-generated target tokens
    rollout_logprobs_BT: torch.Tensor  # float, engine logprob of each generated token (0 elsewhere)
    advantages_BT: torch.Tensor  # float, advantage broadcast on generated tokens
    group_ids_B: torch.Tensor  # long
    domain_ids_B: torch.Tensor  # long
    domains: tuple[str, ...]  # domain_ids index into this
    rewards_B: torch.Tensor  # float
    old_logprobs_BT: torch.Tensor | None = None  # trainer's logprobs under the policy that generated (set by trainer)
    ref_logprobs_BT: torch.Tensor | None = None
    routed_experts_BTLK: torch.Tensor | None = None  # long [B, T, L, k] expert ids to replay, -1 on padding
    values_BT: torch.Tensor | None = None
    returns_BT: torch.Tensor | None = None
    loss_weights_BT: torch.Tensor | None = None  # aggregation weights computed on the whole step batch
    # Totals of the whole step batch: micro-batches and the per-rank shards of N trainer ranks keep
    # the step's values, so every normalisation is global and N ranks compute one rank's update.
    step_tokens: int = 0  # real tokens
    step_seqs: int = 0  # sequences
    step_loss_tokens: float = 0.0  # loss-masked target tokens
    routes_from: str = "none"  # who recorded routed_experts_BTLK: "engine" (R3), "trainer" (R2) or "none"
    # Images: per row, the images feeding its placeholder spans (in order), and the [B, T] bool mask of
    # those spans (never loss-masked). None / () for a text-only batch.
    images_B: tuple[tuple[TokenImage, ...], ...] = ()
    image_mask_BT: torch.Tensor | None = None
    # Rows of one episode (its segments, when its history was compacted: rl/rollout/context.py) share an id;
    # None: every row is an episode of its own. See `EpisodeView`.
    episode_ids_B: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.input_ids_BT.shape[0])

    def select(self, idx: Sequence[int] | slice) -> "TrainBatch":
        """Rows `idx` of every tensor (for micro-batching)."""
        def take(x):
            if x is None or not isinstance(x, torch.Tensor):
                return x
            return x[idx] if isinstance(idx, slice) else x[torch.as_tensor(list(idx), dtype=torch.long)]
        kw = {f: take(getattr(self, f)) for f in self.__dataclass_fields__ if f not in _SCALARS and f != "images_B"}
        if self.images_B:
            rows = range(self.num_seqs)[idx] if isinstance(idx, slice) else list(idx)
            kw["images_B"] = tuple(self.images_B[i] for i in rows)
        return TrainBatch(domains=self.domains, step_tokens=self.step_tokens or int(self.attention_mask_BT.sum()),
                          step_seqs=self.step_seqs or self.num_seqs,
                          step_loss_tokens=self.step_loss_tokens or float(self.loss_mask_BT.sum()),
                          routes_from=self.routes_from, **kw)

    def with_(self, **kw) -> "TrainBatch":
        return replace(self, **kw)

    def narrowed(self) -> "TrainBatch":
        """The batch without its trailing all-padding columns (every [B, T, ...] tensor cut to the
        longest row). The model is causal and padding is on the right, so no real token's logits change."""
        T = self.input_ids_BT.shape[1]
        width = max(int(self.attention_mask_BT.sum(dim=1).max()), 1) if self.num_seqs else T
        if width == T:
            return self
        kw = {f: getattr(self, f)[:, :width] for f in self.__dataclass_fields__
              if f.endswith(("_BT", "_BTLK")) and getattr(self, f) is not None}
        return replace(self, **kw)


_SCALARS = ("domains", "step_tokens", "step_seqs", "step_loss_tokens", "routes_from")


class EpisodeView:
    """Per-episode layout of a batch whose episodes span several rows (segments): each episode's rows side by
    side, in row order, as one row of width (most rows of an episode) x T. Every estimator and aggregation of
    rl/algos reads a row's loss-masked positions in order, so on this layout a segmented episode is one sequence:
    one reward and baseline per episode in its group, GAE and returns across its segments, and sequence-level
    aggregation counting it once. `to_rows` puts per-episode results back on the rows."""

    def __init__(self, episode_ids_B: torch.Tensor, T: int) -> None:
        ids = episode_ids_B.tolist()
        order: dict[int, int] = {}
        self.slot_B: list[int] = []
        counts: dict[int, int] = {}
        for e in ids:
            order.setdefault(e, len(order))
            self.slot_B.append(counts.get(e, 0))
            counts[e] = counts.get(e, 0) + 1
        self.row_E = [order[e] for e in ids]  # the episode (view row) of each batch row
        self.first_E = torch.as_tensor([ids.index(e) for e in order], dtype=torch.long)  # each episode's first row
        self.T = T
        self.width = max(counts.values(), default=1) * T
        self.E = len(order)

    @staticmethod
    def of(batch: "TrainBatch") -> "EpisodeView | None":
        """The view, or None when every row is an episode of its own (nothing to regroup)."""
        ids = batch.episode_ids_B
        if ids is None or int(torch.unique(ids).numel()) == int(ids.numel()):
            return None
        return EpisodeView(ids, int(batch.input_ids_BT.shape[1]))

    def to_episodes(self, x_BT: torch.Tensor, fill: float = 0) -> torch.Tensor:
        out = x_BT.new_full((self.E, self.width, *x_BT.shape[2:]), fill)
        for b, (e, k) in enumerate(zip(self.row_E, self.slot_B)):
            out[e, k * self.T:(k + 1) * self.T] = x_BT[b]
        return out

    def to_rows(self, x_EW: torch.Tensor) -> torch.Tensor:
        return torch.stack([x_EW[e, k * self.T:(k + 1) * self.T] for e, k in zip(self.row_E, self.slot_B)])


@dataclass(frozen=True)
class MicroBatching:
    """How a batch is cut into micro-batches: `rows` per micro-batch, or, with `tokens` > 0
    (`trainer.max_tokens_per_micro_batch`), as many rows as fit `tokens` padded positions (rows x the
    micro-batch's longest row; a row longer than the budget runs alone), whatever their number."""

    rows: int
    tokens: int = 0

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError(f"micro-batching: rows={self.rows} must be >= 1")
        if self.tokens < 0:
            raise ValueError(f"micro-batching: tokens={self.tokens} must be >= 0 (0: by rows)")


def _plan(size: "int | MicroBatching") -> MicroBatching:
    return size if isinstance(size, MicroBatching) else MicroBatching(int(size))


def micro_rows(batch: TrainBatch, size: "int | MicroBatching") -> list[list[int]]:
    """Row indices of each micro-batch of `size` (rows, or a `MicroBatching` token budget): groups
    ordered by their longest row (longest first,
    ties in order of first appearance), a group's rows together and longest first. A micro-batch then
    holds sequences of similar length, so `micro_batches` can cut it to its own longest row: with batch
    order, one long episode (a retry after a malformed call) pads every micro-batch it lands in to its
    length, and compute and activation memory scale with the padded width, not the real tokens. Rows of
    a group share their prompt, and kept together the packed forward computes it once (rl/trainer/packing.py).
    With one row per group this is plain longest-first order.

    With a token budget the rows go longest first whatever their group, and the cut is greedy in that
    order: a micro-batch closes when one more row would take it past the budget (its width is its first
    row's). Whether a row joins depends only on the micro-batch's row count and first row, and a rank's
    shard keeps the step's order, so the shard of whole micro-batches `split_micro_batches` deals is cut
    back into exactly those micro-batches. (Ordered by group, a shard holding part of a group would sort
    that group by a shorter longest row.) Rows of a group of similar lengths still sit together and pack;
    a group of very different lengths may pack in pieces."""
    plan = _plan(size)
    lengths = batch.attention_mask_BT.sum(dim=1).tolist()
    groups = batch.group_ids_B.tolist()
    longest: dict[int, int] = {}
    first: dict[int, int] = {}
    for i, (g, n) in enumerate(zip(groups, lengths)):
        longest[g] = max(longest.get(g, 0), int(n))
        first.setdefault(g, i)
    order = sorted(range(batch.num_seqs), key=lambda i: (-longest[groups[i]], first[groups[i]], -lengths[i], i))
    if not plan.tokens:
        return [order[s:s + plan.rows] for s in range(0, len(order), plan.rows)]
    out: list[list[int]] = []
    for i in sorted(order, key=lambda i: -lengths[i]):  # stable: a group's equal-length rows stay adjacent
        if out and (len(out[-1]) + 1) * max(int(lengths[out[-1][0]]), 1) <= plan.tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def micro_batches(batch: TrainBatch, size: "int | MicroBatching", n_micro: int = 0, pad_only: bool = False) -> list[tuple[TrainBatch, bool]]:
    """`batch` in micro-batches of `size` rows grouped by length (`micro_rows`), each cut to the width
    of its longest row (padding is on the right, so only all-padding columns go), then padding
    micro-batches (its first row, flagged True) up to `n_micro`. Under ZeRO-3 every forward and
    backward gathers parameters collectively, so all ranks must run the same number of micro-batches; a
    rank whose shard is only padding (`pad_only`: fewer sequences than ranks) runs padding alone.
    Callers make padding add nothing to a loss, and put per-row results back in batch order with
    `stitch_rows`."""
    out = [] if pad_only else [(batch.select(rows).narrowed(), False) for rows in micro_rows(batch, size)]
    while len(out) < n_micro:
        out.append((batch.select([0]).narrowed(), True))
    return out


def stitch_rows(parts: Sequence[torch.Tensor], batch: TrainBatch, size: "int | MicroBatching", fill: float = 0.0) -> torch.Tensor:
    """Per-row results of the real micro-batches of `micro_batches(batch, size)` (each [b, t, ...] with
    t <= T), back in batch order as one [B, T, ...] tensor; columns a micro-batch was cut off get `fill`."""
    rows = micro_rows(batch, size)
    if len(parts) != len(rows):
        raise ValueError(f"stitch_rows: {len(parts)} parts for {len(rows)} micro-batches")
    B, T = batch.input_ids_BT.shape
    out = parts[0].new_full((B, T, *parts[0].shape[2:]), fill)
    for idx, part in zip(rows, parts):
        part = part[:, :T]  # a sequence-parallel micro-batch is padded past T (rl/trainer/ulysses.py); those columns are padding
        out[torch.as_tensor(idx, dtype=torch.long), : part.shape[1]] = part
    return out


def split_micro_batches(batch: TrainBatch, n: int, size: "int | MicroBatching") -> list[list[int]]:
    """Row indices for `n` ranks: whole micro-batches of `micro_rows(batch, size)`, each to the rank with
    the fewest real tokens so far, the largest first (LPT scheduling). A rank's rows keep the step's
    length order, so `micro_rows` on its shard rebuilds exactly the micro-batches it was given: every
    micro-batch has the same rows on N ranks as on one, and per-micro-batch terms (the router's
    load-balance loss) match too. A rank may get no rows when the batch has fewer micro-batches than ranks."""
    if n < 1:
        raise ValueError(f"split_micro_batches: n={n} must be >= 1")
    lengths = batch.attention_mask_BT.sum(dim=1).tolist()
    mbs = micro_rows(batch, size)
    tokens = [sum(int(lengths[i]) for i in rows) for rows in mbs]
    loads = [0] * n
    owner = [0] * len(mbs)
    for m in sorted(range(len(mbs)), key=lambda m: (-tokens[m], m)):
        r = min(range(n), key=lambda r: (loads[r], r))
        owner[m] = r
        loads[r] += tokens[m]
    return [[i for m, rows in enumerate(mbs) if owner[m] == r for i in rows] for r in range(n)]


def collate(episodes: Sequence[Episode], advantages_B: Sequence[float], *, pad_id: int = 0,
            domains: Sequence[str] | None = None, group_index: dict[str, int] | None = None) -> TrainBatch:
    """Pad `episodes` into a TrainBatch; `advantages_B[i]` is broadcast over episode i's generated tokens.

    An episode with compacted history (`Episode.segments`) becomes one row per segment, oldest first, each with
    the episode's reward, group and advantage, tied together by `episode_ids_B` (set only when some episode
    has more than one row)."""
    if len(episodes) != len(advantages_B):
        raise ValueError(f"collate: {len(episodes)} episodes but {len(advantages_B)} advantages")
    if not episodes:
        raise ValueError("collate: empty batch")
    if any(e.segments for e in episodes):
        rows = [(i, replace(e, token_ids=s.token_ids, loss_mask=s.loss_mask, rollout_logprobs=s.rollout_logprobs,
                            routed_experts=s.routed_experts, images=s.images, segments=(), token_versions=s.token_versions))
                for i, e in enumerate(episodes) for s in segments_of(e)]
        batch = collate([r for _, r in rows], [advantages_B[i] for i, _ in rows], pad_id=pad_id, domains=domains,
                        group_index=group_index)
        return batch.with_(episode_ids_B=torch.as_tensor([i for i, _ in rows], dtype=torch.long))
    doms = tuple(domains) if domains is not None else tuple(sorted({e.domain for e in episodes}))
    gidx = dict(group_index) if group_index is not None else {}
    B = len(episodes)
    T = max(len(e.token_ids) for e in episodes)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    lmask = torch.zeros((B, T), dtype=torch.float32)
    rlp = torch.zeros((B, T), dtype=torch.float32)
    adv = torch.zeros((B, T), dtype=torch.float32)
    any_images = any(e.images for e in episodes)
    img_mask = torch.zeros((B, T), dtype=torch.bool) if any_images else None
    routes = None
    if all(e.routed_experts is not None for e in episodes):
        shapes = {np.asarray(e.routed_experts).shape[1:] for e in episodes}
        if len(shapes) == 1:
            (LK,) = shapes
            routes = torch.full((B, T, *LK), -1, dtype=torch.long)
    for i, e in enumerate(episodes):
        n = len(e.token_ids)
        if not (len(e.loss_mask) == len(e.rollout_logprobs) == n):
            raise ValueError(f"collate: episode {e.task_id} has ragged token/mask/logprob lengths")
        ids[i, :n] = torch.as_tensor(e.token_ids, dtype=torch.long)
        attn[i, :n] = 1
        m = torch.as_tensor(e.loss_mask, dtype=torch.float32)
        m[0] = 0.0  # the first token has no prediction
        for im in e.images:  # image patches are input, never a target
            if im.start < 0 or im.start + im.length > n:
                raise ValueError(f"collate: episode {e.task_id} has an image span [{im.start}, {im.start + im.length}) "
                                 f"outside its {n} tokens")
            img_mask[i, im.start:im.start + im.length] = True
            m[im.start:im.start + im.length] = 0.0
        lmask[i, :n] = m
        rlp[i, :n] = torch.as_tensor(e.rollout_logprobs, dtype=torch.float32) * m
        adv[i, :n] = float(advantages_B[i]) * m
        if routes is not None:
            r = torch.as_tensor(np.asarray(e.routed_experts), dtype=torch.long)
            routes[i, : r.shape[0]] = r
        gidx.setdefault(e.group_id, len(gidx))
    return TrainBatch(
        input_ids_BT=ids,
        attention_mask_BT=attn,
        loss_mask_BT=lmask,
        rollout_logprobs_BT=rlp,
        advantages_BT=adv,
        group_ids_B=torch.as_tensor([gidx[e.group_id] for e in episodes], dtype=torch.long),
        domain_ids_B=torch.as_tensor([doms.index(e.domain) for e in episodes], dtype=torch.long),
        domains=doms,
        rewards_B=torch.as_tensor([e.reward for e in episodes], dtype=torch.float32),
        routed_experts_BTLK=routes,
        step_tokens=int(attn.sum()),
        step_seqs=B,
        step_loss_tokens=float(lmask.sum()),
        routes_from="engine" if routes is not None else "none",
        images_B=tuple(tuple(e.images) for e in episodes) if any_images else (),
        image_mask_BT=img_mask,
    )


def token_logprobs(logits_BWV: torch.Tensor, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """Logprob of each target token, aligned to targets: out[:, t] = log p(x_t | x_<t); out[:, 0] = 0.

    `logits_BWV` may hold only the last W <= T positions (a forward with `logits_to_keep=W`, see
    `logits_window`): then targets before T - W + 1 have no logits and stay 0.
    """
    T, W = input_ids_BT.shape[1], logits_BWV.shape[1]
    if W > T:
        raise ValueError(f"token_logprobs: {W} logit positions for {T} tokens")
    first = T - W + 1  # first target with a predicting logit
    logp = torch.log_softmax(logits_BWV[:, :-1].float(), dim=-1)
    tgt = input_ids_BT[:, first:].unsqueeze(-1)
    out = torch.zeros(input_ids_BT.shape, dtype=torch.float32, device=logits_BWV.device)
    out[:, first:] = logp.gather(-1, tgt).squeeze(-1)
    return out


def logits_window(loss_mask_BT: torch.Tensor) -> int:
    """How many trailing positions need logits so every loss-masked target gets its logprob.

    Logits at position t - 1 predict token t, so the window starts one before the first masked
    column of the micro-batch. Prompts (system prompt, tool schemas, task text) are most of an
    agent episode's tokens and carry no loss: skipping their [T, V] logits and log-softmax is the
    largest saving of the training step on a small-vocabulary model (measured in
    scripts/bench_train.py). Returns T when nothing is masked (callers then need no logits).
    """
    T = loss_mask_BT.shape[1]
    cols = torch.nonzero(loss_mask_BT.any(0)).flatten()
    if cols.numel() == 0:
        return T
    return T - max(int(cols[0]) - 1, 0)


def image_inputs(batch: TrainBatch, lm_config: object, role: str = "policy") -> dict:
    """`pixel_values` (one [C, H, W] per image, row-major, as the placeholders come) and `image_mask` of a
    micro-batch with images, for a forward of the policy, the reference or the critic; {} for a text-only one.
    Decoded per forward: a PNG of a few KB decodes in well under a millisecond, and the batch stays bytes
    (cheap to shard and ship). ValueError when the batch carries images and `role`'s model has no vision tower."""
    if batch.image_mask_BT is None or not bool(batch.image_mask_BT.any()):
        return {}
    from model.vision import VisionSpec, decode_image, pixel_tensor

    spec = VisionSpec.from_config(lm_config)
    if spec is None:
        raise ValueError(f"the batch carries images but the {role} has no vision tower")
    dev = batch.input_ids_BT.device
    pixels = [pixel_tensor(decode_image(im.data, spec)).to(dev) for row in batch.images_B for im in row]
    return {"pixel_values": pixels, "image_mask": batch.image_mask_BT.to(dev)}
