"""Build-once, cache-on-disk for browsing corpora: pages as files, questions as JSONL, FTS5 index.

The synthetic corpus for (pages, seed, questions, generator version) lives in
``$JOINTRL_CACHE/browse/<key>/`` (default cache: ``.cache/`` in the repo root). Concurrent builders
(several Ray workers starting at once) serialise on a file lock; whoever comes second finds the
finished corpus. A half-written build is never used: `manifest.json` and the index are written
last and atomically. Any other `Corpus` (e.g. `DirectoryCorpus`) gets an index via `ensure_index`.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from envs.browse.corpus import Corpus, DiskCorpus, write_corpus
from envs.browse.index import build_index
from envs.browse.synth import GENERATOR_VERSION, generate
from jointrl import paths
from jointrl.paths import cache_lock

DEFAULT_PAGES = 10_000


def cache_root() -> Path:
    return paths.cache_root() / "browse"


@dataclass(frozen=True)
class BuiltCorpus:
    """A corpus together with its search index file."""

    corpus: Corpus
    index_path: Path
    root: Path



def _generator_fingerprint() -> str:
    """Hash of the generator's source: editing it invalidates cached corpora (no stale question sets)."""
    h = hashlib.sha256()
    for name in ("synth.py", "corpus.py", "render.py", "index.py"):
        h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()[:8]


def synth_key(num_pages: int, seed: int, num_questions: int | None) -> str:
    q = num_questions if num_questions is not None else "auto"
    return f"synth-v{GENERATOR_VERSION}-{_generator_fingerprint()}-p{num_pages}-s{seed}-q{q}"


def load_or_build(num_pages: int = DEFAULT_PAGES, seed: int = 0, num_questions: int | None = None,
                  cache_dir: str | Path | None = None, progress: bool = False, rebuild: bool = False) -> BuiltCorpus:
    """The synthetic corpus for these parameters, generated and indexed on first use, then cached."""
    if num_pages < 50:
        raise ValueError(f"num_pages must be >= 50, got {num_pages}")
    base = Path(cache_dir) / "browse" if cache_dir is not None else cache_root()
    root = base / synth_key(num_pages, seed, num_questions)
    with cache_lock(base / f".{root.name}.lock"):
        ready = (root / "manifest.json").is_file() and (root / "index.sqlite").is_file()
        if ready and not rebuild:
            return BuiltCorpus(DiskCorpus(root), root / "index.sqlite", root)
        if root.exists():
            shutil.rmtree(root)
        world = generate(num_pages, seed, num_questions)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=2 * len(world.pages), desc=f"browse corpus {root.name}", unit="page")
        tmp = root.with_name(root.name + f".tmp{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        params = {"num_pages": num_pages, "num_questions": num_questions, "injected_pages": len(world.injected_paths)}
        disk = write_corpus(tmp, name=root.name, kind="synthetic", seed=seed, pages=world.pages,
                            questions=world.questions, params=params, version=GENERATOR_VERSION, progress=bar)
        build_index(disk, tmp / "index.sqlite", progress=bar)
        if bar is not None:
            bar.close()
        os.replace(tmp, root)
        return BuiltCorpus(DiskCorpus(root), root / "index.sqlite", root)


def ensure_index(corpus: Corpus, cache_dir: str | Path | None = None) -> BuiltCorpus:
    """Index any Corpus (cached by its name and page list) — how a real collection is plugged in."""
    base = Path(cache_dir) / "browse" if cache_dir is not None else cache_root()
    digest = hashlib.sha256("\n".join(corpus.paths()).encode()).hexdigest()[:12]
    root = base / f"external-{corpus.name}-{digest}"
    with cache_lock(base / f".{root.name}.lock"):
        db = root / "index.sqlite"
        if not db.is_file():
            root.mkdir(parents=True, exist_ok=True)
            build_index(corpus, db)
    return BuiltCorpus(corpus, db, root)
