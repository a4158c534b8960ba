"""`HybridMoeForCausalLM`: the seed articles' hybrid sparse MoE as a transformers model.

Stack: token (+ image patch) embedding -> `num_hidden_layers` decoder layers -> zero-centred RMSNorm -> lm_head.
Each decoder layer (Qwen3-Next's layout and names) is
    h = h + mixer(input_layernorm(h))      mixer = `linear_attn` (GatedDeltaNet)   for "linear_attention"
                                                 = `self_attn`   (GatedIndexedAttention) for "indexed_attention"
    h = h + mlp(post_attention_layernorm(h))     mlp = SparseMoeBlock (or DenseMLP for `mlp_only_layers`)

Outputs (`HybridMoeCausalLMOutput`, a transformers `MoeCausalLMOutputWithPast` plus named terms):
  loss = lm_loss + router_aux_loss_coef * aux_loss + router_z_loss_coef * z_loss + indexer_loss_coef * indexer_loss
  (each term added only when computed), `router_logits` (one [tokens, experts] tensor per MoE layer, with
  `output_router_logits=True`), `routed_experts` ([moe_layers, tokens, k], always), `expert_load`
  ([moe_layers, experts]), `indexer_loss` (when requested or training with indexer_loss_coef > 0).
Routing replay: pass `routed_experts` [moe_layers, tokens, k] (tokens = B*T row-major) to reuse recorded routes.
Caches: transformers' own `DynamicCache(config=...)` — `LinearAttentionLayer` (conv + recurrent state) for delta
layers, `DynamicIndexedLayer` (K/V + indexer keys) for DSA layers — so `generate()` works unchanged.
Images: `pixel_values` [N_img, C, H, W] (or a list of [C, H, W] of different sizes) are cut into `vision_patch_size`
patches (raster order), linearly embedded (`model.patch_embed.proj`) and written at the `image_token_id`
placeholder positions (or at `image_mask`), in order. Text-only calls never touch the patch embedding. Which
images the model takes and how bytes become pixels: model/vision.py.

What this module does not do: tokenisation / chat templates, vLLM serving (other modules), distributed
training (DeepSpeed wraps it from outside; nothing here is partition-unsafe: experts are ordinary parameters,
routing state is buffers).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from .configuration import LINEAR_ATTENTION, HybridMoeConfig
from .delta import GatedDeltaNet
from .dsa import GatedIndexedAttention, RotaryEmbedding
from .moe import DenseMLP, Experts, MoeLayerRecord, Router, SparseMoeBlock, router_z_loss, switch_aux_loss
from .norms import GatedRMSNorm, ZeroCenteredRMSNorm


@dataclass
class HybridMoeCausalLMOutput(MoeCausalLMOutputWithPast):
    """MoeCausalLMOutputWithPast (loss, aux_loss, logits, past_key_values, hidden_states, attentions, router_logits)
    plus the separately weighted terms and routing telemetry."""

    lm_loss: torch.FloatTensor | None = None
    z_loss: torch.FloatTensor | None = None
    indexer_loss: torch.FloatTensor | None = None
    routed_experts: torch.LongTensor | None = None  # [moe_layers, B*T, k]
    expert_load: torch.FloatTensor | None = None  # [moe_layers, experts], top-k assignment counts over valid tokens


class ImagePatchEmbed(nn.Module):
    """Non-overlapping p x p patches -> Linear(C*p*p -> hidden). One token per patch, raster order."""

    def __init__(self, config: HybridMoeConfig) -> None:
        super().__init__()
        self.patch, self.channels = config.vision_patch_size, config.vision_num_channels
        self.proj = nn.Linear(self.channels * self.patch * self.patch, config.hidden_size, bias=True)

    def forward(self, pixel_values_NCHW: torch.Tensor) -> torch.Tensor:
        n, c, h, w = pixel_values_NCHW.shape
        p = self.patch
        if c != self.channels or h % p or w % p:
            raise ValueError(f"pixel_values must be [N, {self.channels}, H, W] with H, W multiples of {p}; got {tuple(pixel_values_NCHW.shape)}")
        x = pixel_values_NCHW.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)  # N, gh, gw, C, p, p
        return self.proj(x.reshape(n * (h // p) * (w // p), c * p * p).to(self.proj.weight.dtype))  # [patches, D]


_RECOMPUTE = threading.local()  # set while activation checkpointing re-runs a layer's forward in the backward


@contextmanager
def _recomputing():
    _RECOMPUTE.active = True
    try:
        yield
    finally:
        _RECOMPUTE.active = False


class HybridMoeDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: HybridMoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = GatedIndexedAttention(config, layer_idx)
        self.mlp = (SparseMoeBlock(config) if config.is_moe_layer(layer_idx)
                    else DenseMLP(config.hidden_size, config.intermediate_size))
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_BTD, cos, sin, past_key_values=None, key_padding_BS=None, replay_idx_NK=None,
                compute_indexer_loss: bool = False, use_cache: bool | None = None):
        B, T, _ = hidden_BTD.shape
        x = self.input_layernorm(hidden_BTD)
        idx_loss = None
        if self.layer_type == LINEAR_ATTENTION:
            pad_BT = None if key_padding_BS is None else key_padding_BS[:, -T:]
            x = self.linear_attn(x, past_key_values, pad_BT)
        else:
            x, idx_loss = self.self_attn(x, cos, sin, past_key_values, key_padding_BS, compute_indexer_loss)
        hidden_BTD = hidden_BTD + x
        x = self.post_attention_layernorm(hidden_BTD)
        record = None
        if isinstance(self.mlp, SparseMoeBlock):
            token_mask = None if key_padding_BS is None else key_padding_BS[:, -T:].reshape(-1)
            if getattr(_RECOMPUTE, "active", False):  # the forward already counted these tokens' expert load
                load_E = self.mlp.gate.load_accum.clone()
                x, record = self.mlp(x, replay_idx_NK, token_mask)
                self.mlp.gate.load_accum.copy_(load_E)
            else:
                x, record = self.mlp(x, replay_idx_NK, token_mask)
        else:
            x = self.mlp(x)
        return hidden_BTD + x, record, idx_loss


class HybridMoePreTrainedModel(PreTrainedModel):
    config_class = HybridMoeConfig
    config: HybridMoeConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HybridMoeDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _is_stateful = True  # delta layers carry recurrent state: no cache cropping / assisted decoding
    _supports_sdpa = False
    _keys_to_ignore_on_load_missing = [r"load_accum"]

    @staticmethod
    def recompute_context():
        """`torch.utils.checkpoint`'s `context_fn` for the decoder layers: the (forward, recompute) contexts.
        A layer re-run by activation checkpointing must not add its tokens to the expert-load counter that
        the aux-loss-free bias step reads a second time (rl/trainer/checkpointing.py passes this)."""
        return nullcontext(), _recomputing()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
        """transformers' switch, non-reentrant by default and with `recompute_context` (the expert loads are
        counted once) unless the caller brings its own `context_fn` or asks for reentrant checkpointing."""
        ckpt = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        if not ckpt["use_reentrant"]:
            ckpt.setdefault("context_fn", self.recompute_context)
        super().gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Conv1d):
            # depthwise causal conv of the delta layer: PyTorch's default kaiming-uniform (Qwen3-Next leaves it so)
            bound = 1.0 / module.kernel_size[0] ** 0.5
            init.uniform_(module.weight, -bound, bound)
        elif isinstance(module, ZeroCenteredRMSNorm):
            init.zeros_(module.weight)  # (1 + w): zero is identity
        elif isinstance(module, GatedRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, GatedDeltaNet):
            init.ones_(module.dt_bias)
            # A in [0.01, 16] as in Qwen3-Next / Mamba2: per-head decay rates spanning short and long memories
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(0.01, 16).log_())
        elif isinstance(module, Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, RotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq())
        elif isinstance(module, Router):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
            init.zeros_(module.load_accum)


class HybridMoeModel(HybridMoePreTrainedModel):
    def __init__(self, config: HybridMoeConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.patch_embed = ImagePatchEmbed(config)
        self.layers = nn.ModuleList(HybridMoeDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_parameters["rope_theta"])
        if config.rope_parameters.get("rope_type", "default") != "default":
            raise ValueError(f"only rope_type 'default' is implemented, got {config.rope_parameters['rope_type']!r}")
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def embed(self, input_ids_BT: torch.Tensor, pixel_values, image_mask_BT: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with image patches written at the image positions, in order.

        `pixel_values`: [N, C, H, W], or a sequence of [C, H, W] tensors of different sizes (concatenated
        patches, image after image). `image_mask_BT`: which positions the patches go to; default: every
        `image_token_id` token. Pass it when a sequence may hold a placeholder token that no image feeds
        (one the policy generated itself): vLLM embeds such a token as text, and so does this then.
        """
        x_BTD = self.embed_tokens(input_ids_BT)
        if pixel_values is None:
            if image_mask_BT is not None and bool(image_mask_BT.any()):
                raise ValueError("image_mask marks image positions but no pixel_values were given")
            return x_BTD
        if isinstance(pixel_values, torch.Tensor):
            patches_PD = self.patch_embed(pixel_values)
        else:
            patches_PD = torch.cat([self.patch_embed(px[None]) for px in pixel_values]) if len(pixel_values) else \
                x_BTD.new_zeros((0, x_BTD.shape[-1]))
        is_img_BT = input_ids_BT == self.config.image_token_id if image_mask_BT is None else image_mask_BT.bool()
        n_slots = int(is_img_BT.sum())
        if n_slots != patches_PD.shape[0]:
            raise ValueError(f"{n_slots} image positions (placeholder id {self.config.image_token_id}) in input_ids but "
                             f"pixel_values give {patches_PD.shape[0]} patches; they must match")
        return x_BTD.masked_scatter(is_img_BT[..., None], patches_PD.to(x_BTD.dtype))

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, pixel_values=None, routed_experts=None, output_hidden_states=None,
                compute_indexer_loss: bool = False, image_mask=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids, pixel_values, image_mask)
        elif pixel_values is not None:
            raise ValueError("pixel_values need input_ids (to find the image placeholders), not inputs_embeds")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None and not self.training:
            past_key_values = DynamicCache(config=self.config)
        if not use_cache:
            past_key_values = None
        B, T, _ = inputs_embeds.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] != past + T:
                raise ValueError(f"attention_mask must be 2-D [batch, past + current] = [{B}, {past + T}]; got {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.bool()
            if bool(attention_mask.all()):
                attention_mask = None  # no padding: skip the masking work
        if position_ids is None:
            if attention_mask is not None:  # left padding: positions count real tokens only
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -T:]
            else:
                position_ids = torch.arange(past, past + T, device=inputs_embeds.device)[None].expand(B, T)
        moe_layers = self.config.moe_layer_indices
        if routed_experts is not None:
            want = (len(moe_layers), B * T, self.config.num_experts_per_tok)
            if tuple(routed_experts.shape) != want:
                raise ValueError(f"routed_experts must be [moe_layers, batch*seq, k] = {list(want)}; got {list(routed_experts.shape)}")
        cos, sin = self.rotary_emb(position_ids, inputs_embeds.dtype)

        h = inputs_embeds
        all_hidden = [] if output_hidden_states else None
        records: list[MoeLayerRecord] = []
        idx_losses: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if all_hidden is not None:
                all_hidden.append(h)
            replay = None
            if routed_experts is not None and i in moe_layers:
                replay = routed_experts[moe_layers.index(i)]
            h, rec, idx_loss = layer(h, cos, sin, past_key_values=past_key_values, key_padding_BS=attention_mask,
                                     replay_idx_NK=replay, compute_indexer_loss=compute_indexer_loss, use_cache=use_cache)
            if rec is not None:
                records.append(rec)
            if idx_loss is not None:
                idx_losses.append(idx_loss)
        h = self.norm(h)
        if all_hidden is not None:
            all_hidden.append(h)
        return h, past_key_values, records, idx_losses, (tuple(all_hidden) if all_hidden is not None else None), attention_mask


class HybridMoeForCausalLM(HybridMoePreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridMoeConfig) -> None:
        super().__init__(config)
        self.model = HybridMoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                labels=None, use_cache=None, output_router_logits=None, output_hidden_states=None, pixel_values=None,
                routed_experts=None, output_indexer_loss=None, logits_to_keep: int = 0, return_dict=None,
                image_mask=None, **kwargs) -> HybridMoeCausalLMOutput:
        cfg = self.config
        output_router_logits = cfg.output_router_logits if output_router_logits is None else output_router_logits
        if output_indexer_loss is None:
            output_indexer_loss = self.training and cfg.indexer_loss_coef > 0
        h, cache, records, idx_losses, hiddens, pad_mask = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
            pixel_values=pixel_values, routed_experts=routed_experts, output_hidden_states=output_hidden_states,
            compute_indexer_loss=output_indexer_loss, image_mask=image_mask)
        sl = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        logits = self.lm_head(h[:, sl, :])
        T = h.shape[1]
        token_mask_N = None if pad_mask is None else pad_mask[:, -T:].reshape(-1)

        lm_loss = None
        if labels is not None:
            if logits_to_keep:
                raise ValueError("labels need full logits: do not combine them with logits_to_keep")
            shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
            shift_labels = labels[:, 1:].reshape(-1).to(shift_logits.device)
            lm_loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)

        aux = z = None
        if records and output_router_logits:
            scores = [r.scores_NE if cfg.scoring_func == "softmax" else r.scores_NE / r.scores_NE.sum(-1, keepdim=True)
                      for r in records]
            aux = switch_aux_loss(scores, [r.selected_NK for r in records], cfg.num_experts, token_mask_N)
        if records and (output_router_logits or cfg.router_z_loss_coef > 0):
            z = router_z_loss([r.router_logits_NE for r in records], token_mask_N)
        idx_loss = torch.stack(idx_losses).mean() if idx_losses else None

        loss = None
        if lm_loss is not None:
            loss = lm_loss
            if aux is not None and cfg.router_aux_loss_coef:
                loss = loss + cfg.router_aux_loss_coef * aux
            if z is not None and cfg.router_z_loss_coef:
                loss = loss + cfg.router_z_loss_coef * z
            if idx_loss is not None and cfg.indexer_loss_coef:
                loss = loss + cfg.indexer_loss_coef * idx_loss

        return HybridMoeCausalLMOutput(
            loss=loss, aux_loss=aux, logits=logits, past_key_values=cache, hidden_states=hiddens,
            router_logits=tuple(r.router_logits_NE for r in records) if output_router_logits else None,
            lm_loss=lm_loss, z_loss=z, indexer_loss=idx_loss,
            routed_experts=torch.stack([r.selected_NK for r in records]) if records else None,
            expert_load=torch.stack([r.load_E for r in records]) if records else None,
        )

    # ---------------------------------------------------------------- routing-balance helpers for the trainer
    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def accumulated_expert_load(self) -> torch.Tensor:
        """[moe_layers, experts] top-k counts accumulated by training forwards since the last bias update
        (all-reduce this across data-parallel ranks before `update_expert_bias(loads=...)`)."""
        return torch.stack([b.gate.load_accum for b in self.moe_blocks()])

    @torch.no_grad()
    def update_expert_bias(self, loads: torch.Tensor | None = None, rate: float | None = None) -> bool:
        """One aux-loss-free bias step on every MoE layer. No-op (returns False) when `freeze_expert_bias`."""
        if self.config.freeze_expert_bias:
            for b in self.moe_blocks():
                b.gate.load_accum.zero_()
            return False
        rate = self.config.expert_bias_update_rate if rate is None else rate
        for i, b in enumerate(self.moe_blocks()):
            b.update_expert_bias(rate, None if loads is None else loads[i])
        return True


__all__ = ["HybridMoeForCausalLM", "HybridMoeModel", "HybridMoePreTrainedModel", "HybridMoeCausalLMOutput"]
