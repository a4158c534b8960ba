"""The wire record of an adapter-only weight sync: a LoRA adapter as peft writes it, sent as bytes.

With LoRA (`trainer.lora.rank > 0`) the base weights never change, so where the engine can apply
adapters a sync is the adapter alone: `adapter_config.json` and `adapter_model.safetensors` as
`peft.PeftModel.save_pretrained` writes them. `AdapterBucket` carries both files' bytes through
Ray's object store (so it reaches workers on any node); the worker writes them into a directory of
its own and hands vLLM a `LoRARequest` for it (rl/rollout/engine.py, `load_adapter`).

It also holds what the engine needs of LoRA (`vllm_max_lora_rank`), so rl/rollout never imports the
trainer. What this module does not do: build the adapter (rl/trainer/lora.py), choose between the adapter
and the merged path (rl/trainer/lora.py, `lora_sync_path`), or load anything into an engine.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterBucket:
    """One whole adapter sync: peft's two files, byte for byte, and the policy version they hold."""

    version: int
    config_json: bytes  # adapter_config.json (r, lora_alpha, target_modules, ...)
    weights: bytes  # adapter_model.safetensors (lora_A / lora_B tensors under peft's names)

    @property
    def num_bytes(self) -> int:
        """What crosses to a worker: both files (the safetensors file dominates)."""
        return len(self.config_json) + len(self.weights)

    @property
    def rank(self) -> int:
        return int(json.loads(self.config_json)["r"])

    @staticmethod
    def from_dir(adapter_dir: str | os.PathLike[str], version: int) -> "AdapterBucket":
        d = Path(adapter_dir)
        return AdapterBucket(version=int(version), config_json=(d / ADAPTER_CONFIG).read_bytes(),
                             weights=(d / ADAPTER_WEIGHTS).read_bytes())

    def write(self, parent: str | os.PathLike[str]) -> str:
        """Write the two files into a fresh directory under `parent`; returns its path."""
        Path(parent).mkdir(parents=True, exist_ok=True)
        d = Path(tempfile.mkdtemp(prefix=f"adapter-v{self.version}-", dir=parent))
        (d / ADAPTER_CONFIG).write_bytes(self.config_json)
        (d / ADAPTER_WEIGHTS).write_bytes(self.weights)
        return str(d)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank` (vLLM allows a fixed set of values)."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    for a in allowed:
        if a >= rank:
            return a
    raise ValueError(f"trainer.lora.rank {rank} exceeds vLLM's largest max_lora_rank ({allowed[-1]})")
