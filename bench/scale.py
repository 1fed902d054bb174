"""Flat memory from a feature store of any size: the tiny target trained from stores of N, 4N and
16N samples, each run a fresh `dflash run` process.

For each size: a chat JSONL of that many conversations (random words, seeded), its tokenization
cache warmed, and a feature store beside it (`data.features/`, written with dflash's own writer
in parts of 256 samples; random bf16 features of the target's width, so every batch is a store
hit and the target never runs). Then `dflash run` for a fixed number of steps, with its
anonymous resident memory (`RssAnon` in /proc, polled every 20 ms) and its time from start to
the first step measured from outside, tokens/s from its `run_end` record, and the store
reader's share of the wall time (its own CPU time, `run_end.feature_store.cpu_s`, and its
spans in the `profile` records, `target.feature_store_read`).

    .venv/bin/python bench/scale.py            # N = 2000: 2,000 / 8,000 / 32,000 samples
    .venv/bin/python bench/scale.py --n 500 --steps 20 --repeat 1   # a quick look

The last line is one JSON object: samples, and 16N against N: rss_anon_growth (fraction),
startup_ratio, tok_s_ratio, reader_share (the largest of the three runs: the reads' own CPU
time over the training's wall time) and reader_span_share (their spans in the profile, which
also count waiting for a core or the GIL while the other stages run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = [f"w{i}" for i in range(400)]


def _model(folder: Path) -> None:
    """A random tiny Qwen3 and a word-level ChatML tokenizer, as a local HF folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dflash.config import TinyTargetConfig
    from dflash.model.target import build_tiny
    from tests.test_regen_files import CHATML, SPECIALS  # the tests' ChatML template and special tokens

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", "removed"), pre_tokenizers.Split("\n", "isolated")]
    )
    words = [" ".join(WORDS), "\n", "system user assistant"]
    tok.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|mask|>"],
    )  # fmt: skip
    hf.chat_template = CHATML
    build_tiny(TinyTargetConfig(vocab_size=len(hf))).save_pretrained(folder)
    hf.save_pretrained(folder)


def _data(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(n):
            user = " ".join(rng.choices(WORDS, k=rng.randint(8, 24)))
            reply = " ".join(rng.choices(WORDS, k=rng.randint(24, 72)))
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": reply}]}) + "\n")  # fmt: skip


def _config(root: Path, name: str, data: Path, model: Path, steps: int) -> Path:
    import tomli_w

    cfg = {
        "run": {"name": name, "output_dir": str(root / "runs"), "seed": 0},
        "target": {"kind": "hf", "path": str(model), "stop_token": "<|im_end|>"},
        "data": {"source": "files", "files": [{"path": str(data)}], "cache_dir": str(root / "cache"),
                 "batch_size": 8, "max_seq_len": 128},
        "drafter": {"num_layers": 1, "block_size": 8, "max_anchors": 16, "mask_token_id": 4},
        "train": {"max_steps": steps, "log_every": 1},
        "eval": {"at_end": False},
        "checkpoint": {"export_final": False},
        "profile": {"interval_s": 1.0},
    }  # fmt: skip
    path = root / f"{name}.toml"
    path.write_text(tomli_w.dumps(cfg), encoding="utf-8")
    return path


def _store(config: Path) -> int:
    """Tokenize (warming the cache) and write the feature store beside the data file; the samples."""
    import torch

    from dflash.config import load_config
    from dflash.data.tokenize import load_samples
    from dflash.features.files import Entry, FeatureMeta, folder_for, write_part
    from dflash.model.loading import load_tokenizer
    from dflash.model.target import load_target

    cfg = load_config(config)
    target = load_target(cfg.target, torch.device("cpu"), cfg.drafter.num_layers, cfg.data.cache_dir)
    samples, _ = load_samples(cfg.data, load_tokenizer(cfg.target, cfg.data.cache_dir), progress=False)
    meta = FeatureMeta.of(target)
    folder = folder_for(Path(cfg.data.files[0].path))
    g = torch.Generator().manual_seed(0)
    for part, start in enumerate(range(0, len(samples), 256)):
        chunk = samples[start : start + 256]
        entries = [
            Entry(s.input_ids, torch.randn(s.length, meta.width, generator=g).bfloat16(), s.input_ids.roll(-1))
            for s in chunk
        ]
        write_part(folder, part, entries, meta)
    return len(samples)


def watch_rss_anon(pid: int, every_s: float) -> tuple[list[int], threading.Event]:
    """Poll process `pid`'s RssAnon (kB) from /proc every `every_s` in a thread: ([peak], the
    event that stops it)."""
    peak, done = [0], threading.Event()

    def poll() -> None:
        status = Path(f"/proc/{pid}/status")
        while not done.is_set():
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        peak[0] = max(peak[0], int(line.split()[1]))
            except OSError:
                return
            time.sleep(every_s)

    threading.Thread(target=poll, daemon=True).start()
    return peak, done


def _run(config: Path) -> dict[str, Any]:
    """One `dflash run`: peak RssAnon, start to first step, tokens/s, the store reader's share."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash", "run", str(config)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    peak, done = watch_rss_anon(proc.pid, 0.02)
    first = None
    records = []
    assert proc.stdout is not None
    for line in proc.stdout:
        rec = json.loads(line)
        records.append(rec)
        if rec.get("event") == "train_step" and first is None:
            first = time.perf_counter() - t0
    proc.wait()
    done.set()
    if proc.returncode != 0:
        raise SystemExit(f"dflash run {config} failed (exit {proc.returncode})")
    (end,) = [r for r in records if r["event"] == "run_end"]
    read = sum(p["stages"].get("target.feature_store_read", {}).get("total_s", 0.0)
               for p in records if p["event"] == "profile")  # fmt: skip
    assert end["feature_store"]["misses"] == 0, end["feature_store"]
    return {
        "rss_anon_mb": round(peak[0] / 1024, 1),
        "reader_cpu_share": round(end["feature_store"]["cpu_s"] / end["train_s"], 4),
        "startup_s": round(first or 0.0, 2),
        "tok_s": end["tokens_per_s"],
        "reader_share": round(read / end["train_s"], 4) if end["train_s"] else None,
        "store_hits": end["feature_store"]["hits"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="the smallest store's samples (N)")
    ap.add_argument("--steps", type=int, default=200, help="training steps per run")
    ap.add_argument("--repeat", type=int, default=3, help="runs per size, in rotation (medians are reported)")
    ap.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one)")
    args = ap.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="dflash-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    if not model.is_dir():
        _model(model)
    sizes = [args.n, 4 * args.n, 16 * args.n]
    configs = []
    for n in sizes:
        data = root / f"data{n}.jsonl"
        configs.append(_config(root, f"n{n}", data, model, args.steps))
        if not data.exists():
            _data(data, n, seed=n)
            _store(configs[-1])
    runs: list[list[dict[str, Any]]] = [[] for _ in sizes]
    for _ in range(args.repeat):  # in rotation: a slow minute of the machine hits every size alike
        for i, config in enumerate(configs):
            runs[i].append(_run(config))
    results = []
    for n, rs in zip(sizes, runs, strict=True):
        r = {k: statistics.median(x[k] or 0.0 for x in rs) for k in rs[0]}
        results.append(r)
        share, cpu = 100 * r["reader_share"], 100 * r["reader_cpu_share"]
        print(f"{n:>7} samples: RssAnon {r['rss_anon_mb']} MB, first step after {r['startup_s']} s, "
              f"{r['tok_s']} tok/s ({', '.join(str(x['tok_s']) for x in rs)}), store reader {cpu:.2f} % of wall "
              f"in CPU time ({share:.2f} % in spans); medians of {len(rs)}", flush=True)  # fmt: skip
    a, b = results[0], results[-1]
    print(json.dumps({
        "samples": sizes,
        "rss_anon_growth": round(b["rss_anon_mb"] / a["rss_anon_mb"] - 1, 4),
        "startup_ratio": round(b["startup_s"] / a["startup_s"], 3),
        "tok_s_ratio": round(b["tok_s"] / a["tok_s"], 3),
        "reader_share": max(r["reader_cpu_share"] for r in results),
        "reader_span_share": max(r["reader_share"] or 0.0 for r in results),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
