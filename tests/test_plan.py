"""`dflash plan` (dflash/roofline/plan.py) and the profile's MFU (profiler `roofline`): the
plan from configs alone, its refusals, the split and fit it names; MFU per stage in profile
records and in `dflash report`."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, dflash, json_lines


def _plan(*args: str) -> dict:
    proc = dflash("plan", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_plan_json_names_throughput_bottleneck_fit_and_memory_per_device():
    p = _plan(str(ROOT / "bench" / "plan" / "seed.toml"), "--gpu", "h100", "--gpus", "8", "--row-length", "2686",
              "--target-s", "12")  # fmt: skip
    assert p["bottleneck"] in ("target", "drafter") and p["tokens_per_s"] > 0 and isinstance(p["fits"], bool)
    assert len(p["devices"]) == 8 and all(d["memory_gib"] > 0 for d in p["devices"])
    assert p["current"]["target"] == 5 and p["current"]["drafter"] == 3 and p["current"]["bottleneck"] == "target"
    assert p["mfu"]["target.model_forward"] == pytest.approx(p["target"]["gflop_per_batch"] * 1e9 / 12 / 989.4e12,
                                                             rel=1e-3)  # fmt: skip
    assert (
        p["device"]["peak_source"] == "table" and "copies overlapping compute (shown, not added)" in p["not_modelled"]
    )
    assert p["best"]["tokens_per_s"] == max(s["tokens_per_s"] for s in p["splits"])


def test_a_target_too_large_for_one_gpu_points_at_a_tensor_parallel_engine(tmp_path):
    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936}))  # fmt: skip
    p = _plan(str(ROOT / "bench" / "plan" / "seed.toml"), "--set", f'target.path="{folder}"', "--gpu", "h200")
    assert not p["fits"] and p["target"]["params_b"] > 60
    assert "target.engine = 'vllm'" in p["advice"] and "target.engine_tensor_parallel = 2" in p["advice"]
    text = dflash("plan", str(ROOT / "bench" / "plan" / "seed.toml"), "--set", f'target.path="{folder}"')
    assert text.returncode == 0 and "fits: no" in text.stdout and "target.engine_tensor_parallel = 4" in text.stdout


def test_plan_refuses_bad_input_in_one_line(tmp_path):
    seed = str(ROOT / "bench" / "plan" / "seed.toml")
    for args, says in (
        (["--gpu", "v100"], "unknown GPU 'v100'"),
        (["--gpus", "1"], "--gpus: at least 2"),
        (["--target-s", "1e-9"], "--target-s"),
        (["--calibrate", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
    ):
        proc = dflash("plan", seed, *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and len(lines) == 1 and says in lines[0], (args, proc.stderr)


def test_profile_records_and_report_carry_mfu_per_stage(tmp_path):
    log = tmp_path / "run.jsonl"
    proc = dflash("run", str(ROOT / "configs" / "tiny.toml"), "--set", f'run.output_dir="{tmp_path}"',
                  "--set", "train.max_steps=40", "--set", "profile.interval_s=0.5", "--set", "eval.at_end=false",
                  "--log-file", str(log))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    profiles = [r for r in json_lines(proc.stdout) if r["event"] == "profile" and "roofline" in r]
    assert profiles

    def last(name: str) -> dict:  # a window holds the stages that ran in it: the target may be done before the last
        return next(p["stages"][name] for p in reversed(profiles) if name in p["stages"])

    for name in ("target.model_forward", "drafter.forward", "drafter.backward"):
        assert last(name)["tflops"] > 0 and 0 < last(name)["mfu"] < 1, last(name)
    # the verdict of a window where a matmul stage ran (the last window may hold the optimizer's alone)
    judged = next(p for p in reversed(profiles) if "furthest_below" in p["roofline"])
    roof = judged["roofline"]
    assert roof["peaks"]["cpu"]["source"] == "probe" and roof["furthest_below"] in judged["stages"]
    assert "mfu" not in last("drafter.optimizer_step")  # elementwise: no matmul roofline
    report = dflash("report", str(log))
    assert report.returncode == 0 and "MFU: furthest below its device's peak" in report.stdout, report.stdout
    planned = _plan(str(ROOT / "configs" / "tiny.toml"), "--gpu", "cpu", "--calibrate", str(log))
    assert planned["mfu_from"] == "calibration log" and planned["batch"]["fill_from"] == "calibration run"
    assert planned["step_s"] > 0 and planned["seconds_per_batch"]["drafter_host_work"] > 0


def test_the_peak_probe_is_measured_once_and_cached(tmp_path, monkeypatch):
    import torch

    from dflash.roofline import peaks

    monkeypatch.setenv("DFLASH_PEAKS", str(tmp_path / "peaks.json"))
    first = peaks.probe_peak(torch.device("cpu"), torch.float32, seconds=0.05)
    assert first.source == "probe" and first.tflops > 0 and first.dtype == "float32"
    monkeypatch.setattr(peaks, "_measure", lambda *a: pytest.fail("measured again"))
    assert peaks.probe_peak(torch.device("cpu"), torch.float32) == first
    assert peaks.gpu_spec("NVIDIA H100 80GB HBM3").bf16_tflops == 989.4 and peaks.gpu_spec("h200").memory_gib > 130
