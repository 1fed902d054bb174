"""GGUF in `llama-server` (built by `make llamacpp`, which `make test` runs): `--engine
llamacpp`'s bad inputs (a port in use, a server dying mid-eval, a drafter for another target),
the printed server command, and the round trip: a tiny Llama target with a real tokenizer and a
trained drafter of each family, drafted in `llama-server`: τ > 1 from llama.cpp's counters,
outputs identical to its plain greedy ones and ours. Beside test_gguf.py, so that the two run in
parallel once the build is there."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from dflash.errors import DFlashError
from dflash.model.export import export_drafter
from dflash.serving import llamacpp
from tests.conftest import ROOT, dflash, json_lines, tiny_overrides
from tests.gguf_common import built, drafter_of
from tests.tiny_llama import save_tiny_llama

pytestmark = pytest.mark.engines("llamacpp")  # last, once `make test` has made llama.cpp


def test_a_port_in_use_and_a_server_dying_mid_eval_end_in_one_line(tiny_llama, tmp_path):
    built()
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
    built()
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
    built()
    other = save_tiny_llama(tmp_path / "other", hidden=96)
    export = export_drafter(drafter_of("dflash"), tmp_path / "export")
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
