"""Prober checkpoints: round trip, and clear errors for missing, corrupt, truncated or foreign checkpoints."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fastgate.errors import CheckpointError, ShapeError
from fastgate.gates.checkpoints import load_probe_checkpoint, random_probe_params, save_probe_checkpoint


@pytest.fixture()
def ckpt_dir(tmp_path, tiny):
    params = random_probe_params(2, tiny.hidden_size, 8, seed=4)
    return save_probe_checkpoint(tmp_path / "probe", params, kind="probing", model=tiny, layers=(2, 3),
                                 extra={"theta": 0.0}), params


def test_round_trip_is_bit_exact(ckpt_dir, tiny):
    path, params = ckpt_dir
    ckpt = load_probe_checkpoint(path, tiny, kind="probing")
    assert ckpt.layers == (2, 3) and ckpt.model == tiny.name and ckpt.extra == {"theta": 0.0}
    for a, b in zip(ckpt.params, params):
        assert torch.equal(a, b)


def test_overwrite_keeps_a_valid_checkpoint(ckpt_dir, tiny):
    path, _ = ckpt_dir
    new = random_probe_params(2, tiny.hidden_size, 8, seed=9)
    save_probe_checkpoint(path, new, kind="probing", model=tiny, layers=(1, 2))
    ckpt = load_probe_checkpoint(path, tiny)
    assert ckpt.layers == (1, 2) and torch.equal(ckpt.params.w1, new.w1)


def test_save_never_deletes_a_users_files_and_replaces_a_checkpoint_in_place(tmp_path, tiny):
    """--out on a directory of other files was emptied (its subdirectories failed the save half way, leaving a
    `.old` that failed every later save); a checkpoint directory keeps what else the user put in it."""
    from fastgate.errors import InputError
    from fastgate.gates.checkpoints import check_checkpoint_out

    params = random_probe_params(2, tiny.hidden_size, 8, seed=3)
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "report.md").write_text("keep")
    for _ in range(2):
        with pytest.raises(InputError, match="not a fastgate prober checkpoint"):
            save_probe_checkpoint(mine, params, kind="probing", model=tiny, layers=(1, 2))
    assert sorted(p.name for p in mine.iterdir()) == ["report.md", "sub"] and (mine / "report.md").read_text() == "keep"
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]  # nothing left beside it
    with pytest.raises(InputError, match="not a directory"):
        check_checkpoint_out(mine / "report.md")
    ckpt = tmp_path / "ckpt"
    save_probe_checkpoint(ckpt, params, kind="probing", model=tiny, layers=(1, 2))
    assert oct(ckpt.stat().st_mode & 0o777) != oct(0o700)  # not mkdtemp's private mode
    (ckpt / "notes.txt").write_text("mine")
    new = random_probe_params(2, tiny.hidden_size, 8, seed=4)
    save_probe_checkpoint(ckpt, new, kind="probing", model=tiny, layers=(1, 2))
    assert torch.equal(load_probe_checkpoint(ckpt, tiny).params.w1, new.w1)
    names = sorted(p.name for p in ckpt.iterdir())  # the replaced weights gone, the new under a name of their own
    assert names[:2] == ["config.json", "notes.txt"] and len(names) == 3 and names[2].startswith("weights-")
    # killed between the new weights and the config that names them: the old checkpoint is whole (weights replaced
    # first used to leave new weights beside the old config, which refused them: neither loaded)
    import os as _os

    real = _os.replace

    def dies_at_the_config(src, dst):
        if str(dst).endswith("config.json"):
            raise KeyboardInterrupt
        return real(src, dst)

    _os.replace = dies_at_the_config
    try:
        with pytest.raises(KeyboardInterrupt):
            save_probe_checkpoint(ckpt, params, kind="probing", model=tiny, layers=(1, 2))
    finally:
        _os.replace = real
    assert torch.equal(load_probe_checkpoint(ckpt, tiny).params.w1, new.w1)
    save_probe_checkpoint(ckpt, params, kind="probing", model=tiny, layers=(1, 2))  # and the next save cleans up
    assert torch.equal(load_probe_checkpoint(ckpt, tiny).params.w1, params.w1)
    assert len([p for p in ckpt.iterdir() if p.suffix == ".safetensors"]) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    save_probe_checkpoint(empty, params, kind="probing", model=tiny, layers=(1, 2))
    assert load_probe_checkpoint(empty, tiny).layers == (1, 2)


@pytest.mark.parametrize("edit,message", [
    ({"kind": None}, "kind must be one of probing, confidence"),  # KeyError 'kind'
    ({"kind": "read"}, "kind must be one of"),  # loaded, then judged as a confidence model
    ({"layers": ["a", "b"]}, "layers must be a list of layer numbers"),  # ValueError
    ({"extra": [1]}, "extra must be an object"),  # TypeError
    ({"model_layers": "4"}, "model_layers must be an integer"),
])
def test_a_hand_edited_config_is_a_checkpoint_error(tmp_path, tiny, edit, message):
    import json

    path = tmp_path / "ck"
    save_probe_checkpoint(path, random_probe_params(2, tiny.hidden_size, 8, seed=1), kind="probing", model=tiny,
                          layers=(1, 2))
    config = json.loads((path / "config.json").read_text())
    config.update(edit)
    config = {k: v for k, v in config.items() if v is not None}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_probe_checkpoint(path)


def test_missing_and_corrupt(tmp_path, ckpt_dir, tiny):
    path, _ = ckpt_dir
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        load_probe_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="not 'confidence'"):
        load_probe_checkpoint(path, kind="confidence")
    weights = path / "weights.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated copy
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_probe_checkpoint(path, tiny)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_probe_checkpoint(path)
    (path / "config.json").write_bytes(b"{\xc9\xff\x00 binary")  # not UTF-8 text at all
    with pytest.raises(CheckpointError, match="cannot read"):
        load_probe_checkpoint(path)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_probe_checkpoint(path)


def test_checkpoint_for_another_model_is_rejected(ckpt_dir, tiny):
    from fastgate.testing import tiny_model

    path, _ = ckpt_dir
    other = tiny_model(seed=2)  # same shapes, different weights
    with pytest.raises(CheckpointError, match="trained for model"):
        load_probe_checkpoint(path, other)
    wider = tiny_model(hidden=32)
    with pytest.raises(CheckpointError, match="hidden size"):
        load_probe_checkpoint(path, wider)
    config = json.loads((path / "config.json").read_text())
    config["layers"] = [2, 3, 4]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="weights hold 2 probers"):
        load_probe_checkpoint(path)


def test_save_validates(tmp_path, tiny):
    with pytest.raises(ShapeError, match="hidden size"):
        save_probe_checkpoint(tmp_path / "x", random_probe_params(1, 7, 4), kind="probing", model=tiny, layers=(1,))
    with pytest.raises(ShapeError, match="layers given"):
        save_probe_checkpoint(tmp_path / "x", random_probe_params(1, tiny.hidden_size, 4), kind="probing",
                              model=tiny, layers=(1, 2))
    assert dataclasses.is_dataclass(load_probe_checkpoint(
        save_probe_checkpoint(tmp_path / "y", random_probe_params(1, tiny.hidden_size, 4), kind="confidence",
                              model=tiny, layers=(2,))))


def test_shipped_checkpoints_load():
    from fastgate.gates.checkpoints import default_checkpoint, resolve_checkpoint

    path = default_checkpoint("smollm2-135m", "confidence")
    assert path is not None, "the CBDR confidence model for smollm2-135m should ship in fastgate/checkpoints"
    ckpt = load_probe_checkpoint(path, kind="confidence")
    assert (ckpt.model, ckpt.hidden_size, ckpt.model_layers, len(ckpt.layers)) == ("smollm2-135m", 576, 30, 1)
    assert ckpt.extra["n_rows"] > 1000 and 0.5 < ckpt.extra["val_accuracy"][str(ckpt.layers[0])] <= 1.0
    assert resolve_checkpoint("", "smollm2-135m", "confidence", "cbdr", "x") == path
    assert default_checkpoint("no-such-model", "confidence") is None


def test_a_checkpoint_for_another_model_is_refused_without_a_calibration_warning(tmp_path, tiny_engine,
                                                                                 small_index, caplog):
    """The method is built before a missing calibration is reported: a checkpoint for another model gets its one
    error, not a warning about its threshold first; a checkpoint of this model still gets the warning."""
    import logging

    from fastgate.serving.runtime import AnswerRequest, Runtime
    from fastgate.serving.service import AnswerService, ServiceConfig
    from fastgate.testing import tiny_model

    wider = tiny_model(hidden=32)
    other = save_probe_checkpoint(tmp_path / "other", random_probe_params(2, wider.hidden_size, 8), kind="probing",
                                  model=wider, layers=(2, 3))
    runtime = Runtime("tiny", index=str(small_index), engine=tiny_engine)
    caplog.set_level(logging.WARNING, logger="fastgate.calibration")
    with pytest.raises(CheckpointError, match="hidden size"):
        runtime.build(AnswerRequest("probing", "bm25", (("checkpoint", str(other)),)))
    service = AnswerService(ServiceConfig(method="probing", params=(("checkpoint", str(other)),),
                                          index=str(small_index)), runtime)
    with pytest.raises(CheckpointError, match="hidden size"):  # a server's default method, built at its start
        service.start()
    assert not [r for r in caplog.records if "no calibration" in r.getMessage()]
    own = save_probe_checkpoint(tmp_path / "own", random_probe_params(2, tiny_engine.lm.hidden_size, 8),
                                kind="probing", model=tiny_engine.lm, layers=(2, 3))
    runtime.build(AnswerRequest("probing", "bm25", (("checkpoint", str(own)),)))
    assert [r for r in caplog.records if "no calibration of probing" in r.getMessage()]


def test_a_checkpoint_of_another_kind_is_not_replaced(ckpt_dir, tiny):
    """`train confidence --out` a probing checkpoint replaced the probers (a 15-minute training) unasked; one of the
    same kind is still replaced (retraining)."""
    from fastgate.errors import InputError
    from fastgate.gates.checkpoints import check_checkpoint_out

    path, params = ckpt_dir
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    check_checkpoint_out(path, "probing")
    check_checkpoint_out(path)  # no kind asked: any prober checkpoint, as before
    with pytest.raises(InputError, match="holds a probing checkpoint, and this is a confidence checkpoint: not "
                                         "replacing it"):
        check_checkpoint_out(path, "confidence")
    conf = random_probe_params(1, tiny.hidden_size, 8, seed=5)
    with pytest.raises(InputError, match="holds a probing checkpoint"):
        save_probe_checkpoint(path, conf, kind="confidence", model=tiny, layers=(2,))
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert load_probe_checkpoint(path, tiny, kind="probing").layers == (2, 3)
