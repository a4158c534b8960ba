"""Checkpoints in object storage: sharded export to an fsspec URL, and a parallel, checksummed, resumable pull.

`export_sharded(src_dir, url, num_shards)` rewrites a HF checkpoint's safetensors as `num_shards`
shards of about equal size (`model-0000k-of-0000N.safetensors` plus the HF index, so vLLM and
transformers load the pulled directory as it is), copies the other files (config, tokenizer), and
writes `manifest.json` last: every file's size and sha256. A directory without a manifest is an
unfinished export and is never pulled. `push_dir(dir, url)` uploads an already-built directory
(the MXFP4 exporter's output) the same way.

`pull(url, dest, parallel=8)` downloads the manifest's files on `parallel` threads (fsspec's S3
client is asynchronous, so the threads overlap their requests). Each file goes to `NAME.part`
first, in ranged reads; a `.part` left by an interrupted pull is resumed from its size, not
restarted. A finished file is checked against the manifest's sha256 before it is renamed into
place; a mismatch deletes the download and raises `ShardChecksumError` naming the shard. Files
already in `dest` with the manifest's size and hash are kept.

URLs: `file://`, `s3://` (s3fs; an S3-compatible server through `AWS_ENDPOINT_URL`), `gs://` where
gcsfs is installed (not installed or tested here), and plain local paths.

What this module does not do: quantize (model/mxfp4_export.py) or start engines.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jointrl.digest import sha256_file

MANIFEST = "manifest.json"
FORMAT = "jointrl-shards-v1"
CHUNK_BYTES = 8 << 20


class ObjStoreError(RuntimeError):
    """A problem with an exported checkpoint in object storage, naming the URL or file."""


class ShardChecksumError(ObjStoreError):
    """A pulled file whose sha256 differs from the manifest's."""

    def __init__(self, name: str, got: str, want: str) -> None:
        super().__init__(f"shard {name}: sha256 {got[:16]}... does not match the manifest's {want[:16]}... (download deleted)")
        self.shard = name


@dataclass(frozen=True)
class ManifestFile:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    format: str
    files: tuple[ManifestFile, ...]

    def to_json(self) -> str:
        return json.dumps({"format": self.format, "files": [asdict(f) for f in self.files]}, indent=1)

    @staticmethod
    def from_json(text: str, where: str) -> "Manifest":
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ObjStoreError(f"{where}: manifest format {d.get('format')!r}, expected {FORMAT!r}")
        return Manifest(FORMAT, tuple(ManifestFile(**f) for f in d["files"]))


@dataclass(frozen=True)
class PullStats:
    files: int
    downloaded: int  # files fetched (the others were already in place)
    resumed: int  # files continued from a .part
    bytes: int
    seconds: float


def _fs(url: str) -> tuple[Any, str]:
    import fsspec

    opts: dict[str, Any] = {}
    if url.startswith("s3://") and os.environ.get("AWS_ENDPOINT_URL"):
        opts["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    fs, path = fsspec.core.url_to_fs(url, **opts)
    return fs, path.rstrip("/")


def _manifest_of(local_dir: Path) -> Manifest:
    files = sorted(p for p in local_dir.iterdir() if p.is_file() and p.name != MANIFEST and not p.name.startswith("."))
    return Manifest(FORMAT, tuple(ManifestFile(p.name, p.stat().st_size, sha256_file(p)) for p in files))


def push_dir(local_dir: str | Path, url: str, parallel: int = 8) -> Manifest:
    """Upload every file of `local_dir` to `url`, then the manifest (last: it marks the export complete)."""
    local_dir = Path(local_dir)
    manifest = _manifest_of(local_dir)
    fs, root = _fs(url)
    fs.makedirs(root, exist_ok=True)
    if fs.exists(f"{root}/{MANIFEST}"):
        fs.rm(f"{root}/{MANIFEST}")  # an old export's manifest must not vouch for half-replaced files

    def put(f: ManifestFile) -> None:
        fs.put_file(str(local_dir / f.name), f"{root}/{f.name}")

    with ThreadPoolExecutor(max_workers=parallel) as ex:
        list(ex.map(put, manifest.files))
    with fs.open(f"{root}/{MANIFEST}", "w") as out:
        out.write(manifest.to_json())
    return manifest


def shard_state_dict_files(src_dir: str | Path, out_dir: str | Path, num_shards: int) -> list[str]:
    """Write the checkpoint's tensors as `num_shards` safetensors files of about equal bytes, plus the HF index."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src_dir, out_dir = Path(src_dir), Path(out_dir)
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    srcs = sorted(src_dir.glob("*.safetensors"))
    if not srcs:
        raise ObjStoreError(f"{src_dir}: no *.safetensors files to export")
    tensors: dict[str, Any] = {}
    metadata: dict[str, str] | None = None
    for s in srcs:
        with safe_open(str(s), framework="pt") as f:
            metadata = metadata or f.metadata()
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    names = list(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    # contiguous runs of names, cut when a shard reaches its share of the bytes (never an empty shard)
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    acc, k = 0, 0
    for i, n in enumerate(names):
        left_names, left_shards = len(names) - i, num_shards - k
        if shards[k] and (acc >= total * (k + 1) / num_shards or left_names < left_shards) and k < num_shards - 1:
            k += 1
        shards[k].append(n)
        acc += tensors[n].numel() * tensors[n].element_size()
    shards = [s for s in shards if s]
    files, weight_map = [], {}
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in group}, str(out_dir / fname), metadata=metadata or {"format": "pt"})
        weight_map.update({n: fname for n in group})
        files.append(fname)
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return files


def export_sharded(src_dir: str | Path, url: str, num_shards: int = 8) -> Manifest:
    """Re-shard the checkpoint in `src_dir` and upload it, with its manifest, to `url`."""
    src_dir = Path(src_dir)
    if not (src_dir / "config.json").exists():
        raise ObjStoreError(f"{src_dir}: not a checkpoint directory (no config.json)")
    with tempfile.TemporaryDirectory(prefix="jointrl-export-") as tmp:
        shard_state_dict_files(src_dir, tmp, num_shards)
        for p in src_dir.iterdir():
            if p.is_file() and not p.name.endswith(".safetensors") and p.name not in ("model.safetensors.index.json", MANIFEST):
                shutil.copy2(p, Path(tmp) / p.name)
        return push_dir(tmp, url)


def read_manifest(url: str) -> Manifest:
    fs, root = _fs(url)
    try:
        with fs.open(f"{root}/{MANIFEST}", "r") as f:
            return Manifest.from_json(f.read(), url)
    except FileNotFoundError as e:
        raise ObjStoreError(f"{url}: no {MANIFEST} (not an export, or one that has not finished)") from e


def _pull_one(fs: Any, root: str, f: ManifestFile, dest: Path, chunk_bytes: int) -> tuple[bool, bool, int]:
    """(downloaded, resumed, bytes fetched) for one file."""
    final = dest / f.name
    if final.exists() and final.stat().st_size == f.size and sha256_file(final) == f.sha256:
        return False, False, 0
    part = dest / f"{f.name}.part"
    have = part.stat().st_size if part.exists() else 0
    if have > f.size:
        part.unlink()
        have = 0
    resumed = have > 0
    fetched = 0
    with open(part, "ab") as out:
        while have < f.size:
            end = min(f.size, have + chunk_bytes)
            try:
                data = fs.cat_file(f"{root}/{f.name}", start=have, end=end)
            except OSError as e:  # e.g. a truncated object: the range is not satisfiable
                raise ObjStoreError(f"shard {f.name}: reading bytes {have}-{end} of {f.size} failed: {e}") from e
            if not data:
                raise ObjStoreError(f"shard {f.name}: the server returned no bytes at offset {have} of {f.size}")
            out.write(data)
            have += len(data)
            fetched += len(data)
    got = sha256_file(part)
    if got != f.sha256:
        part.unlink()
        raise ShardChecksumError(f.name, got, f.sha256)
    os.replace(part, final)
    return True, resumed, fetched


def pull(url: str, dest: str | Path, parallel: int = 8, chunk_bytes: int = CHUNK_BYTES) -> PullStats:
    """Fetch the export at `url` into `dest` (see the module docstring); `parallel=1` is the sequential pull."""
    t0 = time.perf_counter()
    manifest = read_manifest(url)
    fs, root = _fs(url)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as ex:
        results = list(ex.map(lambda f: _pull_one(fs, root, f, dest, chunk_bytes), manifest.files))
    (dest / MANIFEST).write_text(manifest.to_json())
    return PullStats(files=len(manifest.files), downloaded=sum(r[0] for r in results), resumed=sum(r[1] for r in results),
                     bytes=sum(r[2] for r in results), seconds=time.perf_counter() - t0)


def main_export_cli(args: Any) -> int:
    """`jointrl export SRC --to URL [--shards N]`, and `--mxfp4 SRC --to URL` (the MXFP4 exporter's directory, uploaded)."""
    import sys

    from model.mxfp4_export import export_mxfp4, resolve_checkpoint_dir

    if args.out is not None:
        print("jointrl export: give an output directory or --to URL, not both", file=sys.stderr)
        return 2
    if args.shards < 1:
        print(f"jointrl export: --shards must be >= 1, got {args.shards}", file=sys.stderr)
        return 2
    src = resolve_checkpoint_dir(args.src)
    if args.mxfp4:
        with tempfile.TemporaryDirectory(prefix="jointrl-mxfp4-") as tmp:
            import torch

            export_mxfp4(src, tmp, args.include, rest_dtype=None if args.rest_dtype is None else getattr(torch, args.rest_dtype))
            m = push_dir(tmp, args.to)
    else:
        m = export_sharded(src, args.to, args.shards)
    print(f"exported {len(m.files)} files to {args.to} ({sum(f.size for f in m.files) / 1e6:.1f} MB)")
    return 0
