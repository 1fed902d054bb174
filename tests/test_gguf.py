"""GGUF for llama.cpp: the drafter's GGUF equals what llama.cpp's own converter writes from our
reference export (every family, every type), the refusals, `dflash export --format gguf`,
`--engine llamacpp` without a build. `llama-server` itself: test_gguf_server.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.errors import CheckpointError, ConfigError
from dflash.model.drafter import DFlashDrafter
from dflash.model.export import export_drafter
from dflash.model.export_gguf import TargetGGUF, gguf_problem, read_target_gguf, write_gguf
from dflash.serving import llamacpp
from tests.conftest import ROOT, dflash
from tests.gguf_common import FAMILIES, SPEC, built, drafter_of

pytestmark = pytest.mark.engines("llamacpp")  # last, once `make test` has made llama.cpp


@pytest.fixture(scope="module")
def target_vocab(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> TargetGGUF:
    built()
    out = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    return read_target_gguf(llamacpp.convert_hf(tiny_llama, out, vocab_only=True))



def _contents(path: Path) -> tuple[dict, dict]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    naming = {"general.name", "general.size_label", "general.basename", "GGUF.kv_count"}
    keys = {k: f.contents() for k, f in reader.fields.items() if k not in naming}
    tensors = {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes()) for t in reader.tensors}
    return keys, tensors


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_gguf_is_what_llamacpps_converter_writes(family, tiny_llama, target_vocab, tmp_path):
    """Every key (but the name) and every tensor's type and bytes, for f16 and q8_0 (its f16
    fallback for short rows too), bf16 once (each conversion is a few seconds of the converter)."""
    model = drafter_of(family)
    export = export_drafter(model, tmp_path / "export", dtype=torch.float32)
    for gtype in ("f16", "q8_0", *(["bf16"] if family == "dflash2" else [])):
        ours = write_gguf(model.spec, model.state_dict(), target_vocab, tmp_path / f"ours-{gtype}.gguf", gtype)
        ref = llamacpp.convert_hf(export, tmp_path / f"ref-{gtype}.gguf", gtype, target_dir=tiny_llama)
        (keys, tensors), (ref_keys, ref_tensors) = _contents(ours), _contents(ref)
        assert keys == ref_keys, (gtype, {k for k in keys.keys() | ref_keys.keys() if keys.get(k) != ref_keys.get(k)})
        assert tensors.keys() == ref_tensors.keys()
        assert [n for n in tensors if tensors[n] != ref_tensors[n]] == [], gtype
    assert keys["dflash.target_layers"] == [2, 3]  # our ids + 1
    assert keys["tokenizer.ggml.mask_token_id"] == 0 and "token_embd.weight" not in tensors


def test_a_draft_vocabulary_is_written_as_llamacpp_reads_it(tiny_llama, target_vocab, tmp_path):
    """DSpark with 256 of 512 rows: every key and tensor as llama.cpp's converter writes them from
    our export (`output.weight` the head's rows, `d2t` absolute I64 ids, no `t2d`); DFlash2's
    successor codebook over every id, the draft rows at their ids (its converter has no d2t)."""
    from gguf import GGUFReader

    ids = torch.arange(0, 512, 2)
    for family in ("dspark", "dflash2"):
        spec = dataclasses.replace(SPEC, **FAMILIES[family], draft_vocab_size=256)
        model = DFlashDrafter(spec)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.1)
        model.set_draft_vocab(ids, torch.randn(512, 64))
        ours = write_gguf(model.spec, model.state_dict(), target_vocab, tmp_path / f"{family}.gguf", "q8_0")
        tensors = {t.name: t for t in GGUFReader(ours).tensors}
        assert "t2d" not in tensors and tensors["d2t"].tensor_type.name == "I64"
        assert np.asarray(tensors["d2t"].data).tolist() == ids.tolist()
        assert list(tensors["output.weight"].shape) == [64, 256]
        if family == "dflash2":
            succ = np.asarray(tensors["selector_successor.weight"].data, dtype=np.float32).reshape(512, -1)
            want = model.candidate_selector.successor_codebook.detach().half().float().numpy()
            assert np.array_equal(succ[ids.numpy()], want) and not succ[1::2].any()
            continue
        export = export_drafter(model, tmp_path / "export", dtype=torch.float32)
        ref = llamacpp.convert_hf(export, tmp_path / "ref.gguf", "q8_0", target_dir=tiny_llama)
        (keys, got), (ref_keys, want_tensors) = _contents(ours), _contents(ref)
        assert keys == ref_keys and got == want_tensors


def test_refusals_name_the_problem_in_one_line(target_vocab, tmp_path):
    ok = dataclasses.replace(target_vocab, arch="llama")
    assert gguf_problem(SPEC, ok) is None
    cases = {
        "qwen2": (SPEC, dataclasses.replace(ok, arch="qwen2")),
        "hidden size 64 is not the target's 96": (SPEC, dataclasses.replace(ok, hidden_size=96)),
        "vocabulary (512) is not the target's (600": (SPEC, dataclasses.replace(ok, vocab_size=600)),
        "reads target layer 3, the last of 4": (dataclasses.replace(SPEC, target_layer_ids=[1, 3]), ok),
    }
    for words, (spec, target) in cases.items():
        why = gguf_problem(spec, target)
        assert why is not None and words in why and "\n" not in why, why
        with pytest.raises(CheckpointError, match="GGUF export"):
            write_gguf(spec, DFlashDrafter(spec).state_dict(), target, tmp_path / "x.gguf")
        assert not (tmp_path / "x.gguf").exists()  # nothing written
    llama3 = dataclasses.replace(SPEC, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(CheckpointError, match="linear or yarn RoPE scaling, not 'llama3'"):
        write_gguf(llama3, DFlashDrafter(SPEC).state_dict(), ok, tmp_path / "x.gguf")


def test_the_end_of_run_gguf_is_refused_where_it_cannot_be_written(tiny_config):
    with pytest.raises(ConfigError, match="tiny target has no vocabulary"):
        tiny_config(**{"checkpoint.export_gguf": '"f16"'})
    with pytest.raises(ConfigError, match=r"needs checkpoint\.export_final = true"):
        tiny_config(**{"checkpoint.export_gguf": '"f16"', "target.kind": '"hf"', "target.path": '"x"',
                       "checkpoint.export_final": "false"})  # fmt: skip


def test_engine_llamacpp_without_a_build_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LLAMACPP", str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="make llamacpp"):
        llamacpp.require_llamacpp()
    tiny = str(ROOT / "configs" / "tiny.toml")
    env = {"DFLASH_LLAMACPP": str(tmp_path / "nothing")}
    proc = dflash("eval", tiny, "--drafter", str(tmp_path / "nothing"), "--engine", "llamacpp", env=env)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "make llamacpp" in proc.stderr
