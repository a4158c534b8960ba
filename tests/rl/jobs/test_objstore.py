"""Weights from object storage: sharded export to file:// and a real S3-API server (moto), parallel pull with
per-shard checksums, resume of partial downloads, refusal of a corrupted shard, and engine logprobs from a pulled dir."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from safetensors.torch import load_file

from jointrl.digest import sha256_file
from rl.model_arg import resolve_model
from rl.weights.objstore import MANIFEST, ObjStoreError, ShardChecksumError, _fs, export_sharded, pull, read_manifest


def _state(d) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(p)))
    return out


def test_file_url_export_pull_resume_and_corruption(tiny_ckpt, tmp_path):
    url = f"file://{tmp_path}/remote/tiny"
    m = export_sharded(tiny_ckpt, url, num_shards=4)
    shards = [f for f in m.files if f.name.endswith(".safetensors")]
    assert len(shards) == 4 and {"config.json", "model.safetensors.index.json"} <= {f.name for f in m.files}
    assert max(f.size for f in shards) < 2.5 * min(f.size for f in shards)  # about equal shards
    dest = tmp_path / "pulled"
    st = pull(url, dest, parallel=4)
    assert (st.files, st.downloaded, st.resumed) == (len(m.files), len(m.files), 0)
    a, b = _state(tiny_ckpt), _state(dest)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(a) and set(index["weight_map"].values()) == {f.name for f in shards}
    # again: everything verified in place, nothing fetched
    assert pull(url, dest).downloaded == 0
    # an interrupted download: the first 1000 bytes of a shard are in NAME.part; only the rest is fetched
    victim = shards[1]
    (dest / victim.name).unlink()
    full = (tmp_path / "remote/tiny" / victim.name).read_bytes()
    (dest / f"{victim.name}.part").write_bytes(full[:1000])
    st = pull(url, dest)
    assert (st.downloaded, st.resumed, st.bytes) == (1, 1, victim.size - 1000)
    assert sha256_file(dest / victim.name) == victim.sha256
    # a shard corrupted in storage is refused by name, and nothing corrupt is left in place
    bad = bytearray(full)
    bad[len(bad) // 2] ^= 0xFF
    (tmp_path / "remote/tiny" / victim.name).write_bytes(bytes(bad))
    dest2 = tmp_path / "pulled2"
    with pytest.raises(ShardChecksumError, match=victim.name) as ei:
        pull(url, dest2)
    assert ei.value.shard == victim.name
    assert not (dest2 / victim.name).exists() and not (dest2 / f"{victim.name}.part").exists()
    with pytest.raises(ObjStoreError, match="no manifest.json"):
        read_manifest(f"file://{tmp_path}/nowhere")


@pytest.mark.slow  # moto's S3 server
def test_s3_export_and_parallel_pull(tiny_ckpt, tmp_path, s3_endpoint):
    url = "s3://jointrl/tiny-8"
    m = export_sharded(tiny_ckpt, url, num_shards=8)
    fs, root = _fs(url)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root)) == sorted([f.name for f in m.files] + [MANIFEST])
    dest = tmp_path / "from-s3"
    st = pull(url, dest, parallel=8)
    assert st.downloaded == len(m.files) and st.bytes == sum(f.size for f in m.files)
    a, b = _state(tiny_ckpt), _state(dest)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # corrupt one shard on the server: refused, naming it
    name = sorted(f.name for f in m.files if f.name.endswith(".safetensors"))[5]
    data = bytearray(fs.cat_file(f"{root}/{name}"))
    data[-10] ^= 0x01
    fs.pipe_file(f"{root}/{name}", bytes(data))
    with pytest.raises(ShardChecksumError, match=name):
        pull(url, tmp_path / "again")
    fs.pipe_file(f"{root}/{name}", bytes(data[:100]))  # truncated in storage: refused by name too
    with pytest.raises(ObjStoreError, match=f"shard {name}"):
        pull(url, tmp_path / "again2")


@pytest.mark.slow  # starts a vLLM engine (and uses the session's policy server)
def test_engine_from_s3_pull_scores_like_one_from_local_disk(tiny_ckpt, tmp_path, s3_endpoint, policy_url):
    """The policy server runs on the local checkpoint; an engine started from the S3 URL must give the same logprobs."""
    from rl.rollout.engine import EngineConfig, RolloutEngine

    url = "s3://jointrl/tiny-engine"
    export_sharded(tiny_ckpt, url, num_shards=8)
    pulled = resolve_model(url).path
    assert len(list(pulled.glob("*.safetensors"))) == 8
    seqs = [[1, 20, 30, 40, 50, 60, 70, 80], [1, 300, 200, 100, 7, 9]]
    from rl.jobs.policy import policy_headers

    local = httpx.post(f"{policy_url}/score", json=seqs, timeout=120, headers=policy_headers()).json()
    eng = RolloutEngine(EngineConfig(model_path=str(pulled), max_model_len=2048, dtype="auto", kv_cache_gib=0.25))
    try:
        remote = [x.tolist() for x in eng.score(seqs)]
    finally:
        eng.shutdown()
    assert remote == local  # identical bytes, identical engine settings: bit-equal logprobs


def test_export_cli_to_url_plain_and_mxfp4(tiny_ckpt, tmp_path, capsys):
    from rl.cli import main

    url = f"file://{tmp_path}/cli"
    assert main(["export", str(tiny_ckpt), "--to", url, "--shards", "3"]) == 0
    names = [f.name for f in read_manifest(url).files]
    assert sum(n.endswith(".safetensors") for n in names) == 3
    assert main(["export", "--mxfp4", str(tiny_ckpt), "--to", f"{url}-mx"]) == 0
    pulled = tmp_path / "mx"
    pull(f"{url}-mx", pulled)
    cfg = json.loads((pulled / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert main(["export", str(tiny_ckpt), str(tmp_path / "out"), "--to", url]) == 2  # both a directory and a URL
    assert main(["export", str(tiny_ckpt), "--to", url, "--shards", "0"]) == 2
    assert "--shards must be >= 1" in capsys.readouterr().err
