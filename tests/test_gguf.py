"""GGUF for llama.cpp: the drafter's GGUF equals what llama.cpp's own converter writes from our
reference export (every family, every type), the refusals, `dflash export --format gguf`,
`--engine llamacpp`'s bad inputs (no build, a port in use, a server dying mid-eval, a drafter
for another target), and the round trip: a tiny Llama target with a real tokenizer and a
trained drafter of each family, drafted in `llama-server` (built by `make llamacpp`, which
`make test` runs): τ > 1 from llama.cpp's counters, outputs identical to its plain greedy ones
and ours."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.errors import CheckpointError, ConfigError, DFlashError
from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.model.export import export_drafter
from dflash.model.export_gguf import TargetGGUF, gguf_problem, read_target_gguf, write_gguf
from dflash.serving import llamacpp
from tests.conftest import ROOT, dflash, json_lines, tiny_overrides
from tests.tiny_llama import save_tiny_llama

pytestmark = pytest.mark.engines("llamacpp")  # last, once `make test` has made llama.cpp

SPEC = DrafterSpec(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128, vocab_size=512,
    rms_norm_eps=1e-5, rope_theta=1e4, target_layer_ids=[1, 2], num_target_layers=4, block_size=4, mask_token_id=0,
    layer_types=["full_attention", "full_attention"], sliding_window=64,
)  # fmt: skip
DFLASH2 = {"family": "dflash2", "conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
FAMILIES = {
    "dflash": {},
    "dflash2": DFLASH2,
    "dspark": {"family": "dspark", "markov_rank": 8, "confidence_head": True, "confidence_with_markov": True},
}


def _built() -> None:
    if not llamacpp.server_binary().is_file():
        pytest.fail(f"llama.cpp is not built in {llamacpp.home()}: `make test` (or `make llamacpp`) builds it")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama") / "model")


@pytest.fixture(scope="module")
def target_vocab(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> TargetGGUF:
    _built()
    out = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    return read_target_gguf(llamacpp.convert_hf(tiny_llama, out, vocab_only=True))


def _drafter(family: str) -> DFlashDrafter:
    torch.manual_seed(0)
    model = DFlashDrafter(dataclasses.replace(SPEC, **FAMILIES[family]))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


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
    model = _drafter(family)
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


def test_a_port_in_use_and_a_server_dying_mid_eval_end_in_one_line(tiny_llama, tmp_path):
    _built()
    target = llamacpp.convert_hf(tiny_llama, tmp_path / "target.gguf")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(DFlashError, match="llama-server did not start") as err:
            llamacpp.Server(target, port=busy.getsockname()[1])
        assert "\n" not in str(err.value)
    assert not _servers_of(target)
    server = llamacpp.Server(target)  # a free port of its own
    try:
        assert server.complete([1, 50, 60], 4)[0]
        server.proc.kill()
        server.proc.wait()
        with pytest.raises(DFlashError, match=r"llama-server died mid-eval \(exit code -9\)"):
            server.complete([1, 50, 60], 4)
    finally:
        server.close()
    assert not _servers_of(target)


def _servers_of(target: Path) -> list[str]:
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return [ln for ln in ps.splitlines() if "llama-server" in ln and str(target) in ln]


@pytest.mark.slow
@pytest.mark.timeout(900)  # four tiny trainings, each drafted in llama-server: ~2.5 min on two cores
def test_trained_drafters_of_each_family_draft_losslessly_in_llamacpp(tiny_llama, tmp_path):
    _built()
    dspark = {"drafter.dspark.markov_rank": 32, "checkpoint.export_gguf": '"q8_0"'}  # and its end-of-run GGUF
    pruned = {"drafter.draft_vocab_size": 256}  # DFlash2 and DSpark with a draft vocabulary: its head and d2t
    dflash2 = {"drafter.dflash2.selector_top_k": 4, **pruned}
    runs = (("dflash", {}), ("dflash", pruned), ("dflash2", dflash2), ("dspark", {**dspark, **pruned}))
    for i, (family, extra) in enumerate(runs):
        shape = {
            "target.kind": '"hf"', "target.path": f'"{tiny_llama}"', "target.layer_ids": "[1, 2]",
            "drafter.mask_token_id": 0, "drafter.block_size": 4, "drafter.family": f'"{family}"',
            "data.num_samples": 128, "train.epochs": 2, "eval.at_end": "false", "eval.num_prompts": 6,
            "data.cache_dir": f'"{tmp_path / "cache"}"', "run.name": f'"{family}{i}"', **extra,
        }  # fmt: skip
        sets = [a for kv in tiny_overrides(tmp_path, **shape) for a in ("--set", kv)]
        trained = dflash("run", str(ROOT / "configs" / "tiny.toml"), *sets)
        assert trained.returncode == 0, trained.stderr[-2000:]
        end = next(r for r in json_lines(trained.stdout) if r["event"] == "run_end")
        assert (Path(end["run_dir"]) / "final.gguf").is_file() == (family == "dspark")  # checkpoint.export_gguf
        proc = dflash("eval", str(ROOT / "configs" / "tiny.toml"), "--drafter", end["export_dir"], *sets,
                      "--engine", "llamacpp")  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        (record,) = [r for r in json_lines(proc.stdout) if r.get("event") == "eval"]
        assert record["engine"] == "llamacpp" and record["prompts"] == 6, record
        assert record["identical_to_llamacpp_greedy"] == 6 and record["identical_to_dflash_greedy"] == 6, record
        assert record["lossless"] and record["tau"] > 1.0 and record["dflash_tau"] > 1.0, record
        assert len(record["accept_per_position"]) == (4 if family == "dspark" else 3), record
        # the export command: the run's own target (an hf folder: its vocabulary converted once)
        out = tmp_path / f"{family}{i}.gguf"
        exported = dflash("export", end["run_dir"], str(out), "--format", "gguf", "--gguf-type", "q8_0")
        assert exported.returncode == 0 and out.is_file(), exported.stderr
        assert "llama-server -m TARGET.gguf -md" in exported.stderr
        spec_type = "draft-dspark" if family == "dspark" else "draft-dflash"
        assert json.loads(exported.stdout.splitlines()[-1])["llama_server"].endswith(
            f"--spec-type {spec_type} --spec-draft-n-max {4 if family == 'dspark' else 3}"
        )


def test_a_drafter_for_another_target_is_refused_before_writing(tiny_llama, tmp_path):
    """`dflash export --format gguf --target` a target whose shape differs: one line."""
    _built()
    other = save_tiny_llama(tmp_path / "other", hidden=96)
    export = export_drafter(_drafter("dflash"), tmp_path / "export")
    home = {"HOME": str(tmp_path)}  # the target's vocabulary is converted once into ~/.cache/dflash
    proc = dflash("export", str(export), str(tmp_path / "d.gguf"), "--format", "gguf", "--target", str(other), env=home)
    (error,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("dflash: error:")]
    assert proc.returncode != 0 and error == proc.stderr.strip().splitlines()[-1], proc.stderr
    assert f"hidden size 64 is not the target's 96 ({other})" in error and not (tmp_path / "d.gguf").exists()
    proc = dflash("export", str(export), str(tmp_path / "d.gguf"), "--format", "gguf")
    assert proc.returncode == 2 and "give the target with --target" in proc.stderr
    proc = dflash("export", str(export), str(tmp_path / "d"), "--format", "gguf", "--target", str(tiny_llama))
    assert proc.returncode == 2 and "ending in .gguf" in proc.stderr


def test_the_printed_llama_server_command_names_the_built_binary_and_its_draft_settings(tmp_path, monkeypatch):
    """The command runs as printed: `make llamacpp`'s llama-server by its path (built or not
    yet), the drafter's flags, and the draft count and minimum probability asked for."""
    monkeypatch.chdir(tmp_path)
    command = llamacpp.serve_command("t.gguf", "d.gguf", "dspark", 2, 0.75)
    binary, rest = command.split(" ", 1)
    assert Path(binary) == llamacpp.server_binary() and binary.endswith("bin/llama-server")
    assert rest == "-m t.gguf -md d.gguf --spec-type draft-dspark --spec-draft-n-max 2 --spec-draft-p-min 0.75"
    plain = llamacpp.serve_command("t.gguf", "d.gguf", "dflash", 3)
    assert plain.endswith("--spec-type draft-dflash --spec-draft-n-max 3")
