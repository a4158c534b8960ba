"""Bringing up a trainer rank: torch.distributed without a launcher, the DeepSpeed config of an engine, and
the causal LM a trainer engine wraps (the policy's, the reference's and the critic's trunk).

What it does not do: build the engines or step them (rl/trainer/policy.py, rl/trainer/critic.py).
"""
from __future__ import annotations

import os

import torch

from rl.http_io import free_port


def deepspeed_config(micro_batch_size: int, grad_clip: float, zero_stage: int | str, dtype: str) -> dict:
    """The DeepSpeed config of a trainer engine (the policy's and the critic's); `zero_stage` may be `auto`, resolved
    against the process group's size (rl/trainer/config.py `resolve_zero_stage`)."""
    import torch.distributed as dist

    from rl.trainer.config import resolve_zero_stage

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        # The driver decides how many micro-batches make one optimizer step (dynamic sampling
        # changes batch sizes); step() is the accumulation boundary.
        "managed_gradient_accumulation": False,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": resolve_zero_stage(zero_stage, world)},
        "bf16": {"enabled": dtype == "bfloat16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def keep_grad_norm(engine) -> None:
    """Make a ZeRO-0 fp32 engine report its pre-clipping gradient norm as the other stages do.

    DeepSpeed 0.19.8 runs ZeRO-0 fp32 clipping through `clip_fp32_gradients`, which drops the norm it computes,
    so `get_global_grad_norm()` stays None. The engine's model step runs after the step's all-reduce, so the norm
    of the gradients at that point is the global one; it is computed here just before it (one pass over the grads).
    """
    if engine.zero_optimization_stage() != 0 or engine.bfloat16_enabled() or engine.fp16_enabled():
        return
    take_step = engine._take_model_step

    def take_step_keeping_norm(lr_kwargs):
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        engine._global_grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        take_step(lr_kwargs)

    engine._take_model_step = take_step_keeping_norm


def check_resume_stage(engine, ckpt_dir: str | os.PathLike[str], tag: str) -> None:
    """Refuse, naming `trainer.zero_stage`, to resume a checkpoint saved under ZeRO-0 into a ZeRO-1/2/3 engine or the
    other way round: DeepSpeed keeps the optimizer state in different files for the two (`zero_pp_rank_*` for ZeRO,
    the model-states file for ZeRO-0) and would fail with an unrelated error. (`auto` is 0 on one rank, 1 on several.)"""
    from pathlib import Path

    state = Path(ckpt_dir) / tag
    if not state.is_dir():
        return
    saved_zero = any(state.glob("zero_pp_rank_*optim_states.pt"))
    now = engine.zero_optimization_stage()
    if saved_zero != (now > 0):
        was = "ZeRO-1, 2 or 3" if saved_zero else "ZeRO-0"
        raise ValueError(f"config key 'trainer.zero_stage': the checkpoint {state} was saved under {was} and this trainer "
                         f"runs ZeRO-{now}; resume with trainer.zero_stage set to the stage it was saved with "
                         f"({'1, 2 or 3' if saved_zero else '0'}; 'auto' is 0 on one rank and 1 on several)")


def init_distributed(rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1", master_port: int | None = None) -> None:
    """Bring up torch.distributed the way DeepSpeed expects, without a launcher (docs/platform.md)."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", "0" if not torch.cuda.is_available() else str(rank % max(1, torch.cuda.device_count())))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port or free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend)


def load_policy(model_dir: str | os.PathLike[str], dtype: str = "float32") -> torch.nn.Module:
    """Load any causal LM checkpoint; `import model` registers the project's HybridMoe with the Auto classes."""
    import model  # noqa: F401  (registers hybrid_moe)
    from transformers import AutoModelForCausalLM

    td = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=td)
    m.config.use_cache = False
    return m


def reset_peak_rss() -> None:
    """Start a new peak of this process's resident memory (Linux: VmHWM back to the current RSS, kernel >= 4.0;
    elsewhere nothing, and `peak_rss_gb` reports the process's lifetime peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_gb() -> float:
    """This process's peak resident memory since `reset_peak_rss` (GiB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
