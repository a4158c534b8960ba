"""Memory-aware admission of local runs: a second run on one machine starts only if it fits beside the first.

Each local `jointrl train` starts a private Ray instance, and every Ray instance's memory monitor watches the
whole node: when the node runs out, a monitor kills the largest worker it owns, whichever run overcommitted.
So a run that starts without RAY_ADDRESS first asks for admission (`admit`):

* its need is estimated from the config (`estimate_run_memory`: the rollout engines, the trainer ranks with
  their optimizer state, the KL reference; the figures come from the measured SmolLM2-MoE run in
  docs/models.md, peak RSS engine 3.79 + trainer 8.29 + reference 3.53 GiB);
* under a file lock in the cache (`<cache>/admission/`), it reads the claims of the other live local runs
  (one JSON file each, named by pid; a dead pid's claim is ignored and removed);
* a run is admitted when its need fits in the memory available now (MemAvailable, or the cgroup's limit
  less its usage, whichever is smaller) less what the other runs have claimed but not yet allocated
  (their claim less the resident memory of their process trees); otherwise it is refused before Ray starts,
  with the figures, and the first run is untouched;
* `$JOINTRL_ADMISSION_GIB` caps the memory all local runs together may claim on this machine (an operator's
  way to keep room for other work); `$JOINTRL_ADMISSION=off` turns the check off.

The claim lives as long as the run's process; nothing here watches memory during a run.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl.trainer.config import resolve_zero_stage

GIB = 1024 ** 3


class AdmissionRefused(RuntimeError):
    """This run does not fit beside the runs already on the machine; the message has the figures."""


@dataclass(frozen=True)
class MemoryNeed:
    engine_gib: float  # all rollout workers
    trainer_gib: float  # all trainer ranks (weights, gradients, Adam moments, activations)
    reference_gib: float  # the KL reference inside the trainer ranks (0 without KL)

    @property
    def total_gib(self) -> float:
        return self.engine_gib + self.trainer_gib + self.reference_gib

    def describe(self) -> str:
        ref = f" + reference {self.reference_gib:.1f}" if self.reference_gib else ""
        return f"engines {self.engine_gib:.1f} + trainer {self.trainer_gib:.1f}{ref}"


def _config_params(c: dict[str, Any]) -> int:
    """Parameters of a decoder from its config.json fields (embeddings, attention, dense or MoE MLP)."""
    h = int(c.get("hidden_size", 0))
    layers = int(c.get("num_hidden_layers", 0))
    vocab = int(c.get("vocab_size", 0))
    experts = int(c.get("num_experts", c.get("num_local_experts", 0)) or 0)
    inter = int((c.get("moe_intermediate_size") if experts else None) or c.get("intermediate_size", 0))
    mlp = 3 * h * inter * max(1, experts) + 3 * h * int(c.get("shared_expert_intermediate_size", 0) or 0)
    return vocab * h * (1 if c.get("tie_word_embeddings") else 2) + layers * (4 * h * h + mlp)


def _safetensors_params(d: Path) -> int:
    """Parameters stored in a checkpoint directory's safetensors files, from their headers (no tensor is read)."""
    total = 0
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                size = 1
                for dim in v["shape"]:
                    size *= int(dim)
                total += size
    return total


def model_params(arch: str) -> int:
    """Parameters of `model.arch` (a pullable name, a shipped shape, a config JSON or a checkpoint dir)."""
    from jointrl.paths import REPO_ROOT
    from rl.models_cli import light_hub

    hub = light_hub()
    if arch in hub.names():
        return hub.get(arch).num_params
    if Path(arch).is_dir():
        try:
            n = _safetensors_params(Path(arch))
        except (OSError, ValueError, KeyError, struct.error):
            n = 0
        if n:
            return n
    for p in (REPO_ROOT / "configs" / "model" / f"{arch}.json", Path(arch) / "config.json", Path(arch)):
        if p.is_file():
            try:
                return _config_params(json.loads(p.read_text()))
            except (OSError, ValueError):
                break
    return 0


def estimate_run_memory(cfg: Any) -> MemoryNeed:
    """A run's peak resident memory, roughly: per engine bf16 weights + its KV cache + ~1.5 GiB of vLLM;
    per trainer rank fp32 weights, gradients and two Adam moments (16 bytes a parameter; ZeRO shards the last
    three over ranks) + ~3 GiB; a KL reference fp32 weights + ~2.2 GiB. The overheads are fitted so the
    measured SmolLM2-MoE run (docs/models.md: engine 3.79, trainer 8.29, reference 3.53 GiB) is covered:
    4.25 / 8.56 / 3.59 GiB here. GPU roles hold weights in GPU memory: only the overhead counts on the host."""
    n = model_params(cfg.model.arch)
    r, t = cfg.rollout, cfg.trainer
    on_gpu_engine = r.gpus_per_worker > 0
    engine = r.num_workers * (1.5 + (0 if on_gpu_engine else n * 2 / GIB + r.kv_cache_gib))
    shard = t.num_workers if resolve_zero_stage(t.zero_stage, t.num_workers) >= 1 else 1
    per_rank = 3.0 + (0 if t.gpus_per_rank else n * (4 + 12 / shard) / GIB)
    a = cfg.algorithm
    ref = (t.num_workers * (2.2 + (0 if t.gpus_per_rank else n * 4 / GIB))) if (a.kl_coef > 0 or a.kl_in_reward) else 0.0
    return MemoryNeed(engine_gib=engine, trainer_gib=t.num_workers * per_rank, reference_gib=ref)


def memory_available() -> float:
    """GiB this process could still allocate: MemAvailable, bounded by a cgroup v2 limit when there is one."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        import psutil

        avail = psutil.virtual_memory().available
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail / GIB


def _tree_rss_gib(pid: int) -> float:
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total / GIB


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def admission_dir() -> Path:
    """One directory per machine, whatever each run's cache: `$JOINTRL_ADMISSION_DIR`, else <tmp>/jointrl-admission
    (sticky and world-writable, so every user's runs see each other's claims)."""
    import tempfile

    env = os.environ.get("JOINTRL_ADMISSION_DIR")
    if env:
        return Path(env)
    d = Path(tempfile.gettempdir()) / "jointrl-admission"
    if not d.exists():
        d.mkdir(exist_ok=True)
        try:
            d.chmod(0o1777)
        except OSError:
            pass
    return d


@dataclass(frozen=True)
class Claim:
    pid: int
    run_dir: str
    need_gib: float


def live_claims(d: Path) -> list[Claim]:
    out = []
    for f in sorted(d.glob("*.json")):
        try:
            c = Claim(**json.loads(f.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if c.pid != os.getpid() and _alive(c.pid):
            out.append(c)
        elif c.pid != os.getpid():
            f.unlink(missing_ok=True)  # that run is gone
    return out


def admit(cfg: Any, run_dir: Path) -> MemoryNeed | None:
    """Claim this run's memory, or raise AdmissionRefused saying why (see the module docstring)."""
    if os.environ.get("RAY_ADDRESS") or os.environ.get("JOINTRL_ADMISSION", "on") == "off":
        return None
    from jointrl.paths import cache_lock

    need = estimate_run_memory(cfg)
    d = admission_dir()
    d.mkdir(parents=True, exist_ok=True)
    with cache_lock(d / ".lock"):
        others = live_claims(d)
        pending = sum(max(0.0, c.need_gib - _tree_rss_gib(c.pid)) for c in others)
        free = memory_available() - pending
        cap = os.environ.get("JOINTRL_ADMISSION_GIB")
        why = ""
        if need.total_gib > free:
            why = (f"it needs ~{need.total_gib:.1f} GiB ({need.describe()}) and {free:.1f} GiB is free "
                   f"({memory_available():.1f} GiB available less {pending:.1f} GiB claimed by runs still starting)")
        elif cap is not None and need.total_gib + sum(c.need_gib for c in others) > float(cap):
            why = (f"it needs ~{need.total_gib:.1f} GiB and the runs already here claim {sum(c.need_gib for c in others):.1f} "
                   f"GiB of the {float(cap):.1f} GiB JOINTRL_ADMISSION_GIB allows")
        if why:
            names = ", ".join(f"{c.run_dir} (pid {c.pid}, ~{c.need_gib:.1f} GiB)" for c in others) or "none"
            raise AdmissionRefused(f"not started: {why}. Runs on this machine: {names}. Wait for one to finish, make this "
                                   "run smaller (rollout.kv_cache_gib, rollout.num_workers, trainer.num_workers), or run "
                                   "it on a Ray cluster (RAY_ADDRESS)")
        (d / f"{os.getpid()}.json").write_text(json.dumps({"pid": os.getpid(), "run_dir": str(run_dir),
                                                           "need_gib": round(need.total_gib, 2)}))
    return need


def release() -> None:
    """Drop this process's claim (also dropped by the next admission once the process is gone)."""
    (admission_dir() / f"{os.getpid()}.json").unlink(missing_ok=True)
