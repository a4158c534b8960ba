"""`jointrl train CONFIG --dry-run`: every check a run makes before it starts, with no side effects.

It loads and validates the config (keys, types, allowed values, cross-section rules, environment ids and
model names with the nearest valid name, files such as `trainer.sft_data`), decides what the run would do
with its run directory (new, resume, refuse: rl/rundir.py), checks the GPUs the config asks for against
this machine's (a refusal), the memory the run needs against what the machine has free now (rl/admission.py;
a warning, since the real run's admission decides at its start), and whether
the sandbox its domains need can start here (envs/sandbox). It prints the resolved config, the placement of
each role, and what a real run would download or build. It downloads nothing, converts nothing, starts no
Ray and writes nothing: a pullable model that is not cached keeps its name and is listed as a pull.
Exit 0 when a real run would start, 2 (with the reasons) when it would be refused.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Sequence


def _gpus_here() -> int:
    """NVIDIA devices visible to this process, from the device files (no CUDA initialisation)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(list(Path("/dev").glob("nvidia[0-9]*")))


def pulls(cfg) -> list[str]:
    """What a real run of `cfg` downloads or builds first: pullable models that are not cached."""
    from rl.models_cli import light_hub

    hub = light_hub()
    out = []
    for key, value in (("model.arch", cfg.model.arch), ("model.reference", cfg.model.reference)):
        if value in hub.names() and not hub.is_cached(value):
            spec = hub.get(value)
            mb = hub._download_bytes(value) / 1e6  # noqa: SLF001 - the listing's own figure
            out.append(f"{key}: pulls {value!r} (downloads {mb:.0f} MB, builds ~{spec.disk_bytes / 1e9:.2f} GB into "
                       f"{hub.local_path(value)}); `jointrl models pull {value}` does it ahead of time")
    return out


def _serving_problem(cfg, *, cpu: bool) -> str | None:
    """What the engine would refuse at start-up for the project's HybridMoe (model/vllm_plugin.check_servable:
    DSA served dense only up to `index_topk` positions, bf16 and head dims on CPU), read from a shipped shape,
    a JSON config or a checkpoint directory; None for other models or when the config is not readable here."""
    import json
    from pathlib import Path

    from model.shipped import CONFIG_DIR, SHIPPED_CONFIGS, load_shipped_config

    arch = cfg.model.arch
    p = CONFIG_DIR / f"{arch}.json" if arch in SHIPPED_CONFIGS else Path(arch)
    p = p / "config.json" if p.is_dir() else p
    try:
        if json.loads(p.read_text()).get("model_type") != "hybrid_moe":
            return None
        hf = load_shipped_config(str(p))
    except (OSError, ValueError, TypeError):
        return None
    import torch

    from model.vllm_plugin import HybridMoeServingError, check_servable, serving_dtype

    dtype = serving_dtype(cfg.rollout.dtype, cpu)  # as the engine resolves it
    try:
        check_servable(hf, cfg.rollout.max_model_len, getattr(torch, dtype), cpu)
    except HybridMoeServingError as e:
        return f"rollout.max_model_len / rollout.dtype / model.arch: {e}"
    return None


def dry_run(path: str | None, overrides: Sequence[str], choice: str = "auto") -> int:
    import yaml

    from rl.admission import estimate_run_memory, memory_available
    from rl.config import load_config, to_dict
    from rl.rundir import decide
    from rl.placement import describe_placement

    t0 = time.perf_counter()
    cfg = load_config(path, overrides)  # pulls nothing; `pulls` below says what a run would
    problems: list[str] = []
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    print("# placement")
    for line in describe_placement(cfg):
        print(line)

    print("# run directory")
    d = decide(to_dict(cfg), cfg.resolved_run_dir(), choice, resume_enabled=cfg.trainer.resume)
    print(d.message)
    if d.action == "refuse":
        problems.append(d.message)

    print("# resources")
    need_gpus = cfg.rollout.num_workers * cfg.rollout.gpus_per_worker + cfg.trainer.num_workers * cfg.trainer.gpus_per_rank
    have = _gpus_here()
    print(f"GPUs: the run asks for {need_gpus:g}; this machine shows {have}")
    if need_gpus > have and not os.environ.get("RAY_ADDRESS"):
        problems.append(f"the run asks for {need_gpus:g} GPU(s) (trainer.gpus_per_rank x trainer.num_workers + "
                        f"rollout.gpus_per_worker x rollout.num_workers) and this machine has {have}; set them to 0 on CPU")
    need = estimate_run_memory(cfg)
    free = memory_available()
    print(f"memory: the run needs ~{need.total_gib:.1f} GiB ({need.describe()}); {free:.1f} GiB available now")
    if not os.environ.get("RAY_ADDRESS") and need.total_gib > free:
        # Memory comes and goes with the machine's other work: the real run's admission decides at its start
        # (rl/admission.py); here it is a warning, not a refusal.
        print(f"warning: ~{need.total_gib:.1f} GiB needed and {free:.1f} GiB available now: a run started now would be "
              "refused until other runs or jobs free memory (docs/training.md, 'Several runs on one machine')")

    problem = _serving_problem(cfg, cpu=have == 0)
    if problem:
        problems.append(problem)
        print(f"engine: refused: {problem}")

    print("# sandbox")
    try:
        from envs.sandbox.bwrap import sandbox_report

        print(sandbox_report())
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001 - a sandbox that cannot start is a refusal, said in its own words
        problems.append(f"sandbox: {e}")
        print(f"refused: {e}")

    if cfg.envs.plugins:
        print(f"# plug-in domains (envs.plugins), loaded: {', '.join(cfg.envs.plugins)}")
    print("# a real run pulls")
    for line in pulls(cfg) or ["nothing (every model it names is cached or a directory)"]:
        print(line)
    print(f"# checked in {time.perf_counter() - t0:.1f} s; nothing was started, written or downloaded")
    if problems:
        for p in problems:
            print(f"jointrl train --dry-run: {p}", file=sys.stderr)
        return 2
    return 0
