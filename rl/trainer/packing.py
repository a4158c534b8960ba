"""Shared-prefix packing: a micro-batch's GRPO groups as token trees, each shared context computed once.

The samples of a group share their prompt: system message, tool schemas, task text. A padded batch
runs that prompt once per sample, and on an agent episode the prompt is most of the tokens. Here each
group of rows becomes one packed row holding the group's token tree (a trie over the rows' tokens, so
identical leading tokens of the generations are shared too), with
- position ids = each token's depth (its position in its own row), so RoPE sees the positions it
  would see unpacked;
- a [P, 1, N, N] boolean attention mask in which a token attends to its ancestors and itself only.

A token's hidden state depends only on its context (its ancestors), so every logit, logprob, route and
gradient equals the padded forward's, to float round-off; the gradients of rows that share a node add
up on that node (autograd sums duplicate reads). The idea is "shared-prefix forward" for GRPO
(Prefix Grouper, Liu et al. 2025; tree attention in SGLang/vLLM serving does the same at inference).

Where to use it: `packing_enabled` (the trainer's `prefix_sharing` against the model's attention) and
`pack_micro_batch` (a micro-batch packs when `should_pack` finds it cheaper and it carries no images).

What it does not do: pack images (micro-batches with images run padded), or train anything.
Pure tensor and list code: no model, no DeepSpeed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from model.families import packing_refusal
from rl.trainer.batch import TrainBatch


@dataclass(frozen=True)
class PrefixPack:
    """A micro-batch of B rows x T columns packed into P rows of N tree nodes."""

    input_ids_PN: torch.Tensor  # long, 0 on padding nodes
    position_ids_PN: torch.Tensor  # long, a node's depth (its column in its rows), 0 on padding
    attention_mask_P1NN: torch.Tensor  # bool, True where query node n may attend key node m (ancestor or self)
    real_PN: torch.Tensor  # bool, False on padding nodes
    domain_ids_P: torch.Tensor  # long, the domain of each packed row's rows
    node_BT: torch.Tensor  # long, flat index p * N + n of the node holding token (b, t); -1 on padding
    source_N: torch.Tensor  # long [P * N], flat index b * T + t of one token each node stands for; -1 on padding

    def to(self, device: torch.device) -> "PrefixPack":
        return PrefixPack(**{f: getattr(self, f).to(device) for f in self.__dataclass_fields__})

    def tokens(self, domains: tuple[str, ...]) -> "PackedTokens":
        """The packed rows as the token record MoE telemetry reads (rl/observe/moe.py `stats_from_forward`)."""
        return PackedTokens(self.input_ids_PN, self.real_PN.long(), self.domain_ids_P, domains)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.input_ids_PN.shape[0]), int(self.input_ids_PN.shape[1])

    @property
    def real_tokens(self) -> int:
        return int(self.real_PN.sum())


@dataclass(frozen=True)
class PackedTokens:
    """Packed rows as tokens: `input_ids_BT` [P, N], `attention_mask_BT` 1 on real nodes, a domain per row."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    domain_ids_B: torch.Tensor
    domains: tuple[str, ...]


def pack_prefixes(input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, group_ids_B: torch.Tensor,
                  domain_ids_B: torch.Tensor, hidden_size: int | None = None) -> PrefixPack | None:
    """One packed row per group of the micro-batch (in order of first appearance), holding the trie of
    its rows' real tokens (right padding: a row's real tokens are its first `sum(attention_mask)`).

    With `hidden_size`, None when the packed forward would cost more than the padded one (`should_pack`),
    decided from the trie's size before any tensor (the [P, 1, N, N] mask above all) is built."""
    B, T = input_ids_BT.shape
    ids = input_ids_BT.tolist()
    lengths = [int(n) for n in attention_mask_BT.sum(dim=1).tolist()]
    groups: dict[int, list[int]] = {}
    for b, g in enumerate(group_ids_B.tolist()):
        groups.setdefault(int(g), []).append(b)
    doms = domain_ids_B.tolist()
    rows_tokens: list[list[int]] = []  # per packed row: node tokens
    rows_depth: list[list[int]] = []
    rows_source: list[list[int]] = []
    paths: list[tuple[int, list[int]]] = [(0, [])] * B  # per row b: (packed row, its node at each column)
    for p, members in enumerate(groups.values()):
        child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node; roots have parent -1
        tokens, depth, source = [], [], []
        for b in members:
            parent, path = -1, []
            for t in range(lengths[b]):
                key = (parent, ids[b][t])
                n = child.get(key)
                if n is None:  # insertion order puts every parent before its children
                    n = child[key] = len(tokens)
                    tokens.append(key[1])
                    depth.append(t)
                    source.append(b * T + t)
                path.append(n)
                parent = n
            paths[b] = (p, path)
        rows_tokens.append(tokens)
        rows_depth.append(depth)
        rows_source.append(source)
    P = len(rows_tokens)
    N = max(1, max(len(r) for r in rows_tokens))
    if hidden_size is not None and not should_pack((P, N), (B, T), hidden_size):
        return None
    ids_PN = torch.zeros(P, N, dtype=torch.long)
    pos_PN = torch.zeros(P, N, dtype=torch.long)
    real_PN = torch.zeros(P, N, dtype=torch.bool)
    source_PN = torch.full((P, N), -1, dtype=torch.long)
    # Every node attends to itself: a padding node then has one key, not none (an all-masked softmax row is NaN).
    mask_PNN = torch.eye(N, dtype=torch.bool).repeat(P, 1, 1)
    dom_P = torch.zeros(P, dtype=torch.long)
    for p, (tokens, depth, source) in enumerate(zip(rows_tokens, rows_depth, rows_source)):
        n = len(tokens)
        ids_PN[p, :n] = torch.as_tensor(tokens, dtype=torch.long)
        pos_PN[p, :n] = torch.as_tensor(depth, dtype=torch.long)
        real_PN[p, :n] = True
        source_PN[p, :n] = torch.as_tensor(source, dtype=torch.long)
    node_BT = torch.full((B, T), -1, dtype=torch.long)
    for b, (p, path) in enumerate(paths):
        if not path:
            continue
        path_L = torch.as_tensor(path, dtype=torch.long)
        node_BT[b, : len(path)] = p * N + path_L
        dom_P[p] = int(doms[b])
        # the node at column t sees the row's nodes at columns <= t: its ancestors and itself
        L = len(path)
        m = mask_PNN[p]
        m[path_L[:, None], path_L[None, :]] |= torch.ones(L, L, dtype=torch.bool).tril()
    return PrefixPack(input_ids_PN=ids_PN, position_ids_PN=pos_PN, attention_mask_P1NN=mask_PNN[:, None],
                      real_PN=real_PN, domain_ids_P=dom_P, node_BT=node_BT, source_N=source_PN.reshape(-1))


def should_pack(packed_PN: tuple[int, int], padded_BT: tuple[int, int], hidden_size: int) -> bool:
    """Whether a forward over P packed rows of N nodes costs less than over B padded rows of T columns.

    Cost per row of width W ~ W * c_token + W^2 * c_pair: a token's matmuls are ~24 h^2 FLOPs and a
    query-key pair's attention ~4 h (Kaplan et al. 2020, "Scaling Laws", FLOP accounting), so a pair
    weighs 1 / (6 h) of a token. Padding columns cost as much as real ones (the model computes them).
    A group with a long shared prompt and short answers packs far below its padded cost; a group of
    long, early-diverging episodes packs into a row whose attention costs more than it saves.
    """
    B, T = padded_BT
    P, N = packed_PN
    per_pair = 1.0 / (6.0 * max(int(hidden_size), 1))
    return P * (N + N * N * per_pair) < B * (T + T * T * per_pair)


def logit_nodes(pack: PrefixPack, loss_mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The node columns that need logits (`logits_to_keep`, sorted) and, for each loss-masked target
    (b, t) in row-major order, the flat row of its predicting node in the kept logits [P * K, V].
    The predictor of token t is the node of token t - 1 in the same row."""
    P, N = pack.shape
    b_M, t_M = torch.nonzero(loss_mask_BT[:, 1:] > 0, as_tuple=True)
    pred_M = pack.node_BT[b_M, t_M]  # token t_M (a column shifted by one) predicts t_M + 1
    if bool((pred_M < 0).any()):
        raise ValueError("logit_nodes: a loss-masked target sits on padding")
    cols_M = pred_M % N
    keep_K = torch.unique(cols_M) if cols_M.numel() else torch.zeros(1, dtype=torch.long)
    where = torch.full((N,), -1, dtype=torch.long)
    where[keep_K] = torch.arange(keep_K.numel())
    return keep_K, (pred_M // N) * keep_K.numel() + where[cols_M]


def packed_logprobs(logits_PKV: torch.Tensor, pack: PrefixPack, keep_K: torch.Tensor, rows_M: torch.Tensor,
                    input_ids_BT: torch.Tensor, loss_mask_BT: torch.Tensor) -> torch.Tensor:
    """log p(x_t | x_<t) [B, T] at every loss-masked target (0 elsewhere) from the packed logits over the
    kept columns; `keep_K`, `rows_M` from `logit_nodes` on the same mask."""
    P, K = logits_PKV.shape[:2]
    if K != keep_K.numel():
        raise ValueError(f"packed_logprobs: {K} logit columns for {keep_K.numel()} kept nodes")
    b_M, t_M = torch.nonzero(loss_mask_BT[:, 1:] > 0, as_tuple=True)
    logp_RV = torch.log_softmax(logits_PKV.reshape(P * K, -1).float(), dim=-1)
    vals_M = logp_RV[rows_M, input_ids_BT[b_M, t_M + 1]]
    B, T = input_ids_BT.shape
    out = torch.zeros(B * T, dtype=vals_M.dtype, device=logits_PKV.device)
    return out.index_put((b_M * T + t_M + 1,), vals_M).reshape(B, T)


def packed_values(v_PN: torch.Tensor, pack: PrefixPack) -> torch.Tensor:
    """Per-node scalars [P, N] (a value head's outputs) back on the rows as V(s_t) [B, T], aligned like
    `token_logprobs`: position t reads the node of token t - 1 (the state before token t), and t = 0 and
    padding are 0. Autograd adds the gradients of rows that read a shared node."""
    B, T = pack.node_BT.shape
    prev_BT = torch.full((B, T), -1, dtype=torch.long, device=pack.node_BT.device)
    prev_BT[:, 1:] = pack.node_BT[:, :-1]
    real_BT = prev_BT >= 0
    out_BT = torch.zeros(B, T, dtype=v_PN.dtype, device=v_PN.device)
    return out_BT.index_put((real_BT,), v_PN.reshape(-1)[prev_BT[real_BT]])


def pack_routes(routes_BTLK: torch.Tensor, pack: PrefixPack) -> torch.Tensor:
    """Per-token expert ids [B, T, L, k] laid out on the nodes [P, N, L, k] (-1 on padding nodes).
    A shared node takes the ids of the row that created it; they are the same function of the same
    context in every row that holds it."""
    B, T, L, k = routes_BTLK.shape
    P, N = pack.shape
    flat = routes_BTLK.reshape(B * T, L, k)
    out = torch.full((P * N, L, k), -1, dtype=routes_BTLK.dtype, device=routes_BTLK.device)
    real = pack.source_N >= 0
    out[real] = flat[pack.source_N[real]]
    return out.reshape(P, N, L, k)


def unpack_routes(routes_LNK: torch.Tensor, pack: PrefixPack) -> torch.Tensor:
    """The expert ids a packed forward used, [L, P * N, k], back on the rows' tokens [B, T, L, k] (-1 on padding)."""
    B, T = pack.node_BT.shape
    L, _, k = routes_LNK.shape
    node = pack.node_BT.reshape(-1)
    out = torch.full((B * T, L, k), -1, dtype=routes_LNK.dtype, device=routes_LNK.device)
    real = node >= 0
    out[real] = routes_LNK.permute(1, 0, 2)[node[real]]
    return out.reshape(B, T, L, k)


def packing_enabled(mode: str, config, role: str) -> bool:
    """Whether a model with this config may run its forwards shared-prefix packed under `trainer.prefix_sharing`
    = `mode` ('on' refuses a model that cannot; `role` names it in the error). Policy, reference and critic."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"trainer.prefix_sharing={mode!r}; allowed values: 'auto', 'on', 'off'")
    if mode == "off":
        return False
    why = packing_refusal(config)
    if why and mode == "on":
        raise ValueError(f"trainer.prefix_sharing='on' but the {role} cannot pack: {why}; use 'auto' or 'off'")
    return not why


def pack_micro_batch(mb: TrainBatch, config) -> PrefixPack | None:
    """`mb` as token trees on its device, or None to run it padded: it carries images, or the packed forward
    would cost more (`should_pack`, from the model's hidden size). Rebuilt on each pass over a micro-batch
    (old logprobs, reference, update, critic): ~30 ms for 8 rows of ~470 tokens, under 1% of the forward it
    saves, so it is not cached."""
    if mb.image_mask_BT is not None:
        return None
    pack = pack_prefixes(mb.input_ids_BT.cpu(), mb.attention_mask_BT.cpu(), mb.group_ids_B.cpu(), mb.domain_ids_B.cpu(),
                         hidden_size=int(config.hidden_size))
    return None if pack is None else pack.to(mb.input_ids_BT.device)
