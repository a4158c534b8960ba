"""Serve records with images (rl/serve/records.py), without a server: the Recorder stores each distinct image
once under its sha256 before the record line, refuses images the record does not name; the reader rebuilds
the sequence's images, refuses an altered or missing file, and reads records written before images were
recorded. Through the real HTTP server: tests/rl/serve/test_serve_tiny.py."""
from __future__ import annotations

import hashlib
import json

import pytest

from rl.serve.records import (RecordedChoice, RecordedImage, Recorder, ServeRecord, load_image, read_records,
                              recorded_sequence)
from rl.types import TokenImage
from tests.helpers.image_env import png

IMG = 10


def _record(rid: str, images: tuple[TokenImage, ...]) -> ServeRecord:
    toks = [1] + [IMG] * 4 + [2] + [IMG] * 8 + [3]
    return ServeRecord(id=rid, created=0.0, model="tiny", policy_version=0, request={"messages": []},
                       prompt_token_ids=tuple(toks), prompt_reused_tokens=0, continues=None,
                       choices=(RecordedChoice(index=0, completion_token_ids=(5, 6), logprobs=(-0.1, -0.2), loss_mask=(1, 1),
                                               finish_reason="stop", text="x", message={"role": "assistant"}),),
                       images=tuple(RecordedImage.of(im) for im in images))


def test_images_are_stored_once_and_read_back_with_their_spans(tmp_path):
    a, b = png(32, 32, 1), png(64, 32, 2)
    ims = (TokenImage(a, 1, 4), TokenImage(b, 6, 8))
    rec = Recorder(tmp_path)
    rec.write(_record("r1", ims), images=ims)
    rec.write(_record("r2", ims), images=ims)
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == sorted(f"{hashlib.sha256(d).hexdigest()}.png" for d in (a, b))
    line = json.loads(rec.path.read_text().splitlines()[0])
    assert line["images"] == [{"sha256": hashlib.sha256(a).hexdigest(), "start": 1, "length": 4},
                              {"sha256": hashlib.sha256(b).hexdigest(), "start": 6, "length": 8}]
    seq = recorded_sequence(read_records(tmp_path), "r2", record_dir=tmp_path)
    assert seq.images == ims and seq.token_ids[-2:] == (5, 6)
    with pytest.raises(ValueError, match="not the ones the record names"):
        rec.write(_record("r3", ims), images=ims[:1])


def test_an_altered_or_missing_image_and_old_records(tmp_path):
    a = png(32, 32, 1)
    ims = (TokenImage(a, 1, 4),)
    rec = Recorder(tmp_path)
    rec.write(_record("r1", ims), images=ims)
    sha = hashlib.sha256(a).hexdigest()
    (tmp_path / "images" / f"{sha}.png").write_bytes(png(32, 32, 2))
    with pytest.raises(ValueError, match="do not hash"):
        load_image(tmp_path, sha)
    (tmp_path / "images" / f"{sha}.png").unlink()
    with pytest.raises(ValueError, match="is not in"):
        recorded_sequence(read_records(tmp_path), "r1", record_dir=tmp_path)
    d = json.loads(_record("old", ()).to_json())
    del d["images"]  # a record written before images were recorded
    assert ServeRecord.from_json(json.dumps(d)).images == ()
