"""jointrl's policy model: the hybrid sparse MoE (`model_type = "hybrid_moe"`).

Importing this package registers `HybridMoeConfig` / `HybridMoeForCausalLM` with transformers' AutoConfig and
AutoModelForCausalLM (and the per-expert checkpoint layout, see `model/checkpoint.py`). It is cheap: it imports
torch and transformers only (no vLLM, no DeepSpeed).

    import model
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_config(model.load_shipped_config("tiny"))
"""
from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM

from .checkpoint import register_checkpoint_layout
from .configuration import HybridMoeConfig, default_layer_types
from .modeling import HybridMoeCausalLMOutput, HybridMoeForCausalLM, HybridMoeModel
from .shipped import SHIPPED_CONFIGS, load_shipped_config

AutoConfig.register(HybridMoeConfig.model_type, HybridMoeConfig, exist_ok=True)
AutoModelForCausalLM.register(HybridMoeConfig, HybridMoeForCausalLM, exist_ok=True)
register_checkpoint_layout()

__all__ = ["HybridMoeConfig", "HybridMoeForCausalLM", "HybridMoeModel", "HybridMoeCausalLMOutput",
           "default_layer_types", "load_shipped_config", "SHIPPED_CONFIGS"]
