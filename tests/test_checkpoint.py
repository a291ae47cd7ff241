"""Reading a sharded (FSDP2, torch.distributed.checkpoint) checkpoint directory whole: :func:`read_checkpoint`.

A single-file QATModule checkpoint laid out as ModelParallelStrategy writes it (the state dict through DCP, the rest
in ``meta.pt``) reads back to the same state, the quantized layers' extra state (switches, fallback decisions)
included; the export of the directory equals the export of the file; an incomplete directory is refused in one line
naming it and what is missing, and left as it was; pickled code in it is refused as in a file. (The 2-process FSDP2
fit, exported, validated and inspected from its own sharded checkpoint: tests/test_fsdp.py.)
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from qat_app.checkpoint import check_checkpoint_file, read_checkpoint
from qat_app.sharded_checkpoint import LIGHTNING_META_FILE
from qat_app.errors import CheckpointError, UnsafeFileError
from qat_app.export import WEIGHTS_FILE, load_qat_checkpoint
from qat_app.export import main as export_main
from qat_app.hif8.fallback_targets import FallbackDecision
from tests._tiny_models import save_qat_checkpoint, write_sharded

FALLBACK = {"target": "current", "step": 3, "reason": "saturation", "evidence": "5 events in 8 steps"}
LAYER = "model.model.layers.1.mlp.up_proj"


@pytest.fixture(scope="module")
def file_and_dir(module_tmp, tiny_model_dir):
    tmp = module_tmp("sharded")
    ckpt = torch.load(save_qat_checkpoint(tmp / "base.ckpt", tiny_model_dir), weights_only=True)
    ckpt["state_dict"][f"{LAYER}._extra_state"]["fallback"] = {"input": dict(FALLBACK)}  # a decision of the run
    torch.save(ckpt, tmp / "m.ckpt")
    write_sharded(ckpt, tmp / "m_dir")
    return tmp / "m.ckpt", tmp / "m_dir"


def test_a_sharded_directory_reads_back_whole(file_and_dir):
    file, directory = file_and_dir
    saved, read = torch.load(file, weights_only=True), read_checkpoint(str(directory))
    assert read.keys() == {*saved.keys()} - {"optimizer_states"}
    assert read["state_dict"].keys() == saved["state_dict"].keys()
    for key, value in saved["state_dict"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(read["state_dict"][key], value) and read["state_dict"][key].dtype == value.dtype, key
    extra = read["state_dict"][f"{LAYER}._extra_state"]
    assert extra["fallback"] == {"input": FALLBACK} and extra["quantize_weights"] is True
    module = load_qat_checkpoint(directory)  # the extra state loads: the decision is the layer's again
    assert module.model.get_submodule(LAYER.removeprefix("model.")).fallback == {"input": FallbackDecision.from_dict(FALLBACK)}


def test_export_of_the_directory_equals_export_of_the_file(file_and_dir, tmp_path):
    file, directory = file_and_dir
    for source in (file, directory):
        assert export_main(["--ckpt_path", str(source), "--out", str(tmp_path / source.name)]) == 0
    a, b = (load_file(str(tmp_path / name / WEIGHTS_FILE)) for name in (file.name, directory.name))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _shard(d):
    return next(f for f in os.listdir(d) if f.endswith(".distcp"))


INCOMPLETE = {
    "a shard file": (lambda d: os.remove(os.path.join(d, _shard(d))), r"missing __0_0\.distcp \(1 of the 1 shard"),
    ".metadata": (lambda d: os.remove(os.path.join(d, ".metadata")), r"\.metadata is missing"),
    "meta.pt": (lambda d: os.remove(os.path.join(d, "meta.pt")), r"missing meta\.pt"),
    "truncated": (lambda d: os.truncate(os.path.join(d, _shard(d)), 100), r"truncated __0_0\.distcp \(100 of"),
}


@pytest.mark.parametrize("kind", list(INCOMPLETE))
def test_incomplete_directory_is_refused_in_one_line(kind, file_and_dir, tmp_path, capsys):
    import re
    import shutil

    bad = tmp_path / "last.ckpt"
    shutil.copytree(file_and_dir[1], bad)
    damage, pattern = INCOMPLETE[kind]
    damage(bad)
    before = sorted((p.name, p.stat().st_size) for p in bad.iterdir())
    with pytest.raises(CheckpointError, match=f"sharded checkpoint {re.escape(str(bad))} is incomplete: {pattern}"):
        read_checkpoint(str(bad))
    capsys.readouterr()
    assert export_main(["--ckpt_path", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.match(f"error: sharded checkpoint {re.escape(str(bad))} is incomplete: "
                                                   f"{pattern}", err), err
    assert sorted((p.name, p.stat().st_size) for p in bad.iterdir()) == before and not (tmp_path / "out").exists()


class _Runs:
    def __reduce__(self):
        return (os.system, ("echo pickled code ran",))


def test_pickled_code_in_a_directory_is_refused(file_and_dir, tmp_path):
    ckpt = torch.load(file_and_dir[0], weights_only=True)
    ckpt["state_dict"][f"{LAYER}._extra_state"]["fallback"] = {"input": {"target": "current", "x": _Runs()}}
    write_sharded(ckpt, tmp_path / "evil")
    with pytest.raises(UnsafeFileError, match=r"evil \(state_dict\..*up_proj\._extra_state.*\) holds a pickled "
                                              r"reference to (posix|nt)\.system"):
        read_checkpoint(str(tmp_path / "evil"))
    with pytest.raises(UnsafeFileError, match=r"evil \(state_dict\..*up_proj\._extra_state"):
        check_checkpoint_file(str(tmp_path / "evil"), need_training_state=False)  # what a resume checks first


class _ByGetattr:
    """Pickles as ``getattr(owner, name)``: how Python 3.11.2 (Debian 12's) pickles an enum member."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def test_metadata_with_enum_members_pickled_by_getattr_reads_as_data_and_nothing_else_does():
    import io
    import pathlib
    import pickle

    from torch.distributed.checkpoint.planner import WriteItemType

    from qat_app.sharded_checkpoint import _MetadataUnpickler

    member = pickle.dumps(_ByGetattr(WriteItemType, "TENSOR"))
    assert _MetadataUnpickler(io.BytesIO(member)).load() is WriteItemType.TENSOR
    for owner, name in ((pathlib.Path, "home"), (WriteItemType, "__class__")):  # an allowed class, not a member
        with pytest.raises(pickle.UnpicklingError, match="getattr"):
            _MetadataUnpickler(io.BytesIO(pickle.dumps(_ByGetattr(owner, name)))).load()
