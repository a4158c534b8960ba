"""The trainer's side of a weight sync: its module's weights as a plan, and the exporter choosing a transport.

`export_buckets(module, named_weights, ...)` is the one-off form: object-store buckets, nothing
kept. `WeightExporter.export(...)` (one exporter per trainer process) plans the sync
(rl/weights/encode.py) and then writes it either into this process's /dev/shm area (shm.py),
returning `ShmBucket` indexes, or as `WeightBucket`s for Ray's object store, which alias the
weights (fp32) or a reused staging area (bf16 / MXFP4); the caller must `ray.put` those before the
next export or weight change. With transport "auto" shm is chosen when every reader is on this
node and /dev/shm has room; otherwise the object store, and the reason is logged when the choice
changes. `$JOINTRL_SYNC_TRANSPORT` overrides "auto".

Between syncs the exporter keeps the last `SyncLayout` (names, offsets, shapes, dtypes, bucket
boundaries, built indexes), reused while the (name, shape, dtype) signature of the weights and the
format arguments stay the same and rebuilt as soon as any of them changes, and what it reads from the
module (model type, tied embeddings, persistent names), kept while the module object and the
incoming names are the same.

What this module does not do: send anything through Ray (the trainer actor does), or read a sync.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

import torch

from rl.log import get_logger
from rl.weights.encode import SyncLayout, SyncPlan, SyncStaging, plan_sync
from rl.weights.errors import ShmSpaceError, ShmSyncError, WeightSyncError
from rl.weights.shm import SHM_DIR, ShmBucket, ShmSyncArea
from rl.weights.wire import WeightBucket

log = get_logger("weights")

TRANSPORT_ENV = "JOINTRL_SYNC_TRANSPORT"  # auto | shm | object_store: overrides transport="auto" without a config key
Transport = Literal["auto", "shm", "object_store"]
TRANSPORTS: tuple[str, ...] = ("auto", "shm", "object_store")
TRAINER_SYNC_FORMATS: tuple[str, ...] = ("fp32", "bf16", "mxfp4")


# ----------------------------------------------------------------------------- a trainer module's weights
@dataclass(frozen=True)
class ModuleInfo:
    """What a sync needs from the trainer's module besides its weights."""

    model_type: str
    tie_word_embeddings: bool
    persistent: frozenset[str]  # names a checkpoint holds (non-persistent buffers such as rotary `inv_freq` are not)


def module_info(module: torch.nn.Module) -> ModuleInfo:
    cfg = getattr(module, "config", None)
    if cfg is None:
        raise WeightSyncError(f"export_buckets: {type(module).__name__} has no .config (need model_type / tie_word_embeddings)")
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return ModuleInfo(model_type=cfg.model_type, tie_word_embeddings=bool(getattr(text_cfg, "tie_word_embeddings", False)),
                      persistent=frozenset(module.state_dict().keys()))


def trainer_plan(module: torch.nn.Module, named_weights: Iterable[tuple[str, torch.Tensor]], bucket_mb: float, fmt: str,
                 mxfp4_rest: str, *, info: ModuleInfo | None = None, reuse: SyncLayout | None = None) -> SyncPlan:
    """The plan of what a trainer sends; `info` (default: read from `module` now) gives model type, tying, persistent names."""
    if fmt not in TRAINER_SYNC_FORMATS:
        raise WeightSyncError(f"sync format {fmt!r} is not supported; use one of {TRAINER_SYNC_FORMATS}")
    info = module_info(module) if info is None else info
    keep = info.persistent
    kept = {n: t for n, t in named_weights if n in keep}
    return plan_sync(kept, info.model_type, bucket_mb, tie_word_embeddings=info.tie_word_embeddings, fmt=fmt,
                     mxfp4_rest=mxfp4_rest, reuse=reuse)


def export_buckets(
    module: torch.nn.Module,
    named_weights: Iterable[tuple[str, torch.Tensor]],
    bucket_mb: float = 64.0,
    fmt: str = "fp32",
    *,
    copy: bool = True,
    mxfp4_rest: str = "fp32",
    staging: SyncStaging | None = None,
) -> list[WeightBucket]:
    """What a trainer sends to rollout engines: its (gathered, CPU) weights as checkpoint-format buckets.

    `module` supplies the config (model_type, tied embeddings) and the set of persistent names:
    non-persistent buffers (e.g. rotary `inv_freq`) are not part of a checkpoint and are dropped.
    `fmt` = `trainer.sync_format`: "fp32", "bf16" (cast before sending) or "mxfp4" (experts as
    MXFP4, the rest in `mxfp4_rest`; the worker dequantizes to the engine's dtype).
    `copy=False`: buckets alias the weights; `staging`: buckets alias that reused gather area. Either
    way the caller must serialise them (`ray.put`) before the weights change / the next export.
    """
    return trainer_plan(module, named_weights, bucket_mb, fmt, mxfp4_rest).to_buckets(copy=copy, staging=staging)


def requested_transport(transport: str = "auto") -> str:
    """The transport asked for: an explicit "shm" / "object_store" wins; "auto" yields to $JOINTRL_SYNC_TRANSPORT."""
    if transport not in TRANSPORTS:
        raise WeightSyncError(f"sync transport {transport!r} is not supported; use one of {TRANSPORTS}")
    if transport == "auto":
        env = os.environ.get(TRANSPORT_ENV, "").strip() or "auto"
        if env not in TRANSPORTS:
            raise WeightSyncError(f"${TRANSPORT_ENV}={env!r} is not a sync transport; use one of {TRANSPORTS}")
        return env
    return transport


def local_node_id() -> str:
    """This process's Ray node id, or "" outside Ray (then every reader counts as local)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - no Ray, or no runtime context: not a cluster process
        return ""


class WeightExporter:
    """Trainer-side: one object per trainer process, exporting each sync over shm or the object store (module docstring).

    `last_transport` / `last_reason` say what the last export did; `layout` is the cached layout
    the next export reuses if nothing about names, shapes, dtypes or format changed.
    """

    def __init__(self, node_id: str | None = None, shm_dir: str = SHM_DIR, busy_timeout_s: float = 60.0) -> None:
        self.node_id = local_node_id() if node_id is None else node_id
        self.shm_dir = shm_dir
        self.busy_timeout_s = busy_timeout_s
        self.area: ShmSyncArea | None = None
        self.staging = SyncStaging()
        self.layout: SyncLayout | None = None
        self._info: tuple[weakref.ref, tuple[str, ...], ModuleInfo] | None = None
        self.last_transport = ""
        self.last_reason = ""

    def _module_info(self, module: torch.nn.Module, names: tuple[str, ...]) -> ModuleInfo:
        """Model type, tying and persistent names, read again when the module object or the incoming names change."""
        c = self._info
        if c is None or c[0]() is not module or c[1] != names:
            c = self._info = (weakref.ref(module), names, module_info(module))
        return c[2]

    def plan(self, module: torch.nn.Module, named_weights: Iterable[tuple[str, torch.Tensor]], bucket_mb: float = 64.0,
             fmt: str = "fp32", mxfp4_rest: str = "fp32") -> SyncPlan:
        """This sync's plan, on the cached layout when it still applies (the cache is updated)."""
        named = list(named_weights)
        info = self._module_info(module, tuple(n for n, _ in named))
        plan = trainer_plan(module, named, bucket_mb, fmt, mxfp4_rest, info=info, reuse=self.layout)
        self.layout = plan.layout
        return plan

    def _choose(self, requested: str, plan: SyncPlan, reader_nodes: Sequence[str]) -> tuple[str, str]:
        if requested == "object_store":
            return "object_store", "requested"
        foreign = sorted({n for n in reader_nodes if n and self.node_id and n != self.node_id})
        if requested == "auto" and not reader_nodes:
            return "object_store", "reader nodes unknown"
        if foreign:
            why = f"readers on other nodes {foreign} (trainer on {self.node_id})"
            if requested == "shm":
                raise ShmSyncError(f"shared-memory sync forced but {why}")
            return "object_store", why
        if not os.path.isdir(self.shm_dir):
            if requested == "shm":
                raise ShmSyncError(f"shared-memory sync forced but {self.shm_dir} does not exist")
            return "object_store", f"{self.shm_dir} does not exist"
        if self.area is None:
            self.area = ShmSyncArea(self.node_id, self.shm_dir, busy_timeout_s=self.busy_timeout_s)
        ok, why = self.area.fits(plan)
        if not ok:
            if requested == "shm":
                raise ShmSyncError(f"shared-memory sync forced but {why}")
            return "object_store", why
        return "shm", "all readers on this node" if requested == "auto" else "requested"

    def _log_choice(self, how: str, why: str, nbytes: int) -> None:
        if (how, why) != (self.last_transport, self.last_reason):
            fallback = how == "object_store" and why != "requested"
            (log.warning if fallback else log.info)("weight sync transport: %s (%s), %.1f MB per sync", how, why, nbytes / 1e6)
        self.last_transport, self.last_reason = how, why

    def export(self, module: torch.nn.Module, named_weights: Iterable[tuple[str, torch.Tensor]], bucket_mb: float = 64.0,
               fmt: str = "fp32", *, transport: str = "auto", reader_nodes: Sequence[str] = (),
               mxfp4_rest: str = "fp32") -> list[ShmBucket] | list[WeightBucket]:
        requested = requested_transport(transport)
        plan = self.plan(module, named_weights, bucket_mb, fmt, mxfp4_rest)
        how, why = self._choose(requested, plan, reader_nodes)
        if how == "shm":
            assert self.area is not None
            try:
                out = self.area.write(plan)
            except ShmSpaceError as e:  # /dev/shm filled up between the check and the allocation
                if requested == "shm":
                    raise
                how, why = "object_store", str(e)
        self._log_choice(how, why, plan.nbytes)
        if how == "shm":
            return out
        if fmt == "fp32":  # buckets alias the weights: ray.put is the only copy
            return plan.to_buckets(copy=False)
        return plan.to_buckets(copy=True, staging=self.staging)  # cast / encode into warm, reused memory

    def close(self) -> None:
        if self.area is not None:
            self.area.close()
            self.area = None
