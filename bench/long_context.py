"""A drafter's training step on long rows: 16K, 32K and 64K tokens, anchors growing with the row
(`drafter.max_anchors = T / 64`, block 16), the grouped attention path (`drafter.attention =
"grouped"`: memory linear in the row) against the dense mask, one fresh process per point.
Random weights, 576 wide as the demo's drafter, 8 heads of 64 (2 KV heads: they divide over 2
ranks), 1 layer, a draft vocabulary of 8,192. `sp2`: the grouped path with sequence parallelism
over two torchrun ranks (gloo, one process each, `pipeline.sequence_parallel = 2`): each holds half
the context and of the blocks; its figure is the larger rank's.

    .venv/bin/python bench/long_context.py                 # 16K, 32K, 64K; grouped, dense, sp2
    .venv/bin/python bench/long_context.py --rows 16384,32768 --paths grouped
    .venv/bin/python bench/long_context.py --decode 65536  # speculative decoding after a 64K prompt
    .venv/bin/python bench/long_context.py --end-to-end 65536  # regen, then training, on 64K rows

`--decode T`: dflash's greedy speculative decoding of 24 tokens after a T-token prompt (the tiny
config's target and an untrained drafter), against the target's own greedy decoding: lossless or
not, the seconds of each, the process's peak RSS. `--end-to-end T`: three conversations of T tokens
through `dflash regen` (features kept) and `dflash run` at sequence parallelism 2, from the feature
store and again with the target's forward (`end_to_end`): seconds, peak RSS, losses, row lengths.

Memory is the process's peak RSS over one step (the high-water mark reset after set-up) minus
its RSS before it: what the step itself needs. Each point runs with glibc's mmap threshold fixed
(`MALLOC_MMAP_THRESHOLD_=131072`): a freed large block goes back to the system, so RSS follows the
tensors alive, not glibc's raised threshold keeping freed blocks in the heap (which made two ranks
of one step differ by 40 %). A point that fails (out of memory, killed) is
printed as such. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from draft_vocab_step import status_gib  # noqa: E402


def one(T: int, path: str) -> dict:
    import os

    import torch

    from dflash.config import OptimizerConfig
    from dflash.model.drafter import DrafterSpec, FrozenHead
    from dflash.model.loss import LossSpec
    from dflash.model.vocab import DraftVocab
    from dflash.runtime.devices import Device
    from dflash.runtime.messages import Batch, HostFeatures
    from dflash.train.replicas import build_replicas
    from dflash.train.step import MicroStep

    H, V, B = 576, 49152, 16
    spec = DrafterSpec(
        hidden_size=H, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=1536, vocab_size=V,
        rms_norm_eps=1e-6, rope_theta=1e5, target_layer_ids=[1], num_target_layers=4, block_size=B,
        mask_token_id=V - 1, layer_types=["full_attention"], sliding_window=T, draft_vocab_size=8192,
        max_position_embeddings=T + B,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    w = torch.randn(V, H, generator=g) * 0.02
    vocab = DraftVocab(torch.arange(8192), V)
    rep = build_replicas(spec, FrozenHead(w, w), [torch.device("cpu")], OptimizerConfig(), lambda _: 1.0, 0, None,
                         vocab)[0]  # fmt: skip
    ids = torch.randint(0, 8192, (1, T), generator=g)
    mask = torch.ones(1, T, dtype=torch.bool)
    mask[:, : T // 8] = False  # a prompt, then the reply
    batch = Batch(0, 0, ids, mask, torch.zeros(1, T, dtype=torch.long), torch.arange(T)[None], T, 1, False)
    feats = HostFeatures(batch, torch.randn(1, T, H, generator=g), 0)
    micro = MicroStep(LossSpec(block_size=B, gamma=7.0), max_anchors=T // 64, grouped=path in ("grouped", "sp2"))
    if path == "sp2":  # this process is one of two torchrun ranks sharing the row
        import torch.distributed as dist

        from dflash.runtime.sequence import rank_groups

        dist.init_process_group("gloo")
        rep.seq_group, rep.seq_rank = rank_groups(dist.get_rank(), 2, 2, 600.0)
    device = Device("cpu", "d")
    before = status_gib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    prepared = micro.prepare(rep, device, feats, 0)
    parts = micro.compute(rep, device, prepared)
    rep.optimizer.step()
    seconds = time.perf_counter() - t0
    device.close()
    out = {"row_tokens": T, "path": path, "anchors": T // 64, "step_s": seconds,
           "step_gib": status_gib("VmHWM") - before, "loss": float(parts.loss_sum),
           "weight": parts.weight_sum}  # fmt: skip
    if path == "sp2":
        import torch.distributed as dist

        got: list = [None, None]
        dist.all_gather_object(got, out)
        dist.destroy_process_group()
        if os.environ.get("RANK") != "0":
            return {}
        out = {**out, "step_gib": max(g["step_gib"] for g in got), "step_s": max(g["step_s"] for g in got),
               "rank_gib": [round(g["step_gib"], 3) for g in got],
               "loss": sum(g["loss"] for g in got), "weight": sum(g["weight"] for g in got)}  # fmt: skip
    return {**out, "loss": out["loss"] / out["weight"]}


def decode(T: int) -> dict:
    """Greedy speculative decoding after a T-token prompt against the target's own decoding."""
    import resource
    import tempfile

    import torch

    from dflash import load_config
    from dflash.eval.decode import greedy_generate, speculative_generate
    from dflash.train.build import build_training

    out = tempfile.mkdtemp()
    cfg = load_config(ROOT / "configs" / "tiny.toml", [f'run.output_dir="{out}"', "data.num_samples=16",
                                                       "eval.at_end=false"])  # fmt: skip
    t = build_training(cfg)
    target, rep = t.targets[0], t.replicas[0]
    prompt = torch.randint(0, cfg.target.tiny.vocab_size - 1, (T,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        t0 = time.perf_counter()
        plain = greedy_generate(target, prompt, 24, set())
        t1 = time.perf_counter()
        spec = speculative_generate(target, rep.model, rep.head, prompt, 24, set())
        t2 = time.perf_counter()
    return {"prompt_tokens": T, "lossless": list(spec.tokens) == list(plain), "plain_s": round(t1 - t0, 2),
            "speculative_s": round(t2 - t1, 2),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}  # fmt: skip


def end_to_end(T: int, rows: int = 3, steps: int = 4, out: Path | None = None) -> dict:
    """Long rows through the whole tool: `dflash regen` answers `rows` conversations whose user
    turn nearly fills T tokens (a tiny Llama with a byte-level BPE tokenizer and a chat template,
    T positions), keeping the target features; `dflash run` trains on its output at
    `data.max_seq_len = T`, two CPU replicas sharing each row (`pipeline.sequence_parallel = 2`, a
    group's token budget 2 × T/2): from the feature store, then with the target's forward."""
    import resource
    import tempfile

    import numpy as np
    import tomli_w

    from tests.tiny_llama import save_tiny_llama, tiny_tokenizer

    root = Path(out or tempfile.mkdtemp(prefix="dflash-long-"))
    save_tiny_llama(root / "model", positions=T)
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant:{% endif %}")  # fmt: skip
    tok.save_pretrained(root / "model")
    g = np.random.default_rng(0)
    letters = "etaoinhrdlucmfwypvbgk"  # no "s": the mask id, 511, is the merge "so"
    reply, chats = 32, []
    for _ in range(rows):  # words of 2-5 letters, as many as leave room for the template and the reply
        words = ["".join(letters[int(i)] for i in g.integers(0, len(letters), int(n)))
                 for n in g.integers(2, 6, T)]  # fmt: skip
        lo, hi = 0, len(words)
        while lo < hi:  # the most words whose conversation fits
            mid = (lo + hi + 1) // 2
            text = [{"role": "user", "content": " ".join(words[:mid])}]
            rendered = tok.apply_chat_template(text, add_generation_prompt=True, tokenize=False)
            n = len(tok(rendered, add_special_tokens=False).input_ids)
            lo, hi = (mid, hi) if n <= T - 3 * reply else (lo, mid - 1)  # a byte-level reply re-encodes longer
        chats.append({"messages": [{"role": "user", "content": " ".join(words[:lo])}]})
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
    config = {
        "run": {"name": "long", "output_dir": str(root / "runs"), "seed": 0},
        "target": {"kind": "hf", "path": str(root / "model"), "stop_token": "</s>"},
        "regen": {"prompts": str(prompts), "holdout": 0, "max_new_tokens": reply, "batch_size": 1,
                  "save_features": True},
        "data": {"source": "files", "files": [{"path": str(root / "runs" / "long" / "regen.jsonl")}],
                 "cache_dir": str(root / "cache"), "max_seq_len": T, "token_budget": T // 2},
        "drafter": {"num_layers": 1, "block_size": 16, "max_anchors": T // 64, "attention": "grouped",
                    "mask_token_id": 511},
        "pipeline": {"drafter_devices": ["cpu", "cpu"], "sequence_parallel": 2},
        "train": {"max_steps": steps, "log_every": 1},
        "eval": {"at_end": False},
    }  # fmt: skip
    (root / "long.toml").write_text(tomli_w.dumps(config), encoding="utf-8")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    got: dict = {"row_tokens": T, "rows": rows}
    live = ["--set", "data.feature_files=false", "--set", 'run.name="long_target"']  # the target's forward
    legs = [("regen", ["regen"]), ("run", ["run"]), ("run_target", ["run", *live])]
    for leg, args in legs:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "dflash", args[0], str(root / "long.toml"), *args[1:]],
                              capture_output=True, text=True, cwd=ROOT, env=env)  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"dflash {args[0]} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        got[f"{leg}_s"] = round(time.perf_counter() - t0, 1)
        got[f"{leg}_peak_gib"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2)
        records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if leg == "regen":
            end = next(r for r in records if r["event"] == "regen")
            got["replies"], got["features_mb"] = end["generated"], end["features_mb"]
            continue
        end = next(r for r in records if r["event"] == "run_end")
        data = next(r for r in records if r["event"] == "setup")["data"]
        got[leg] = {"losses": [round(r["loss"], 4) for r in records if r["event"] == "train_step"],
                    "row_tokens": data["tokens"] // max(1, data["samples"]), "truncated": data["truncated"],
                    "feature_store_hits": (end["feature_store"] or {}).get("hits", 0),
                    "tokens_per_s": end["tokens_per_s"]}  # fmt: skip
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="16384,32768,65536")
    p.add_argument("--paths", default="grouped,dense,sp2")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--decode", type=int, help="decode after a prompt of this many tokens instead")
    p.add_argument("--end-to-end", type=int, metavar="T", help="regen, then train at SP 2, on rows of T tokens instead")
    a = p.parse_args()
    if a.end_to_end:
        r = end_to_end(a.end_to_end)
        print(json.dumps({"bench": "long_context_end_to_end", **r}))
        return
    if a.decode:
        r = decode(a.decode)
        print(f"{r['prompt_tokens']} prompt tokens: lossless {r['lossless']}, plain {r['plain_s']} s, speculative "
              f"{r['speculative_s']} s, peak RSS {r['peak_rss_gib']} GiB", flush=True)  # fmt: skip
        print(json.dumps({"bench": "long_context_decode", **r}))
        return
    if a.one:
        T, path = a.one.split(":")
        got = one(int(T), path)
        if got:
            print(json.dumps(got))
        return
    rows = []
    for path in a.paths.split(","):
        for T in map(int, a.rows.split(",")):
            launch = [sys.executable] if path != "sp2" else [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]  # fmt: skip
            proc = subprocess.run([*launch, __file__, "--one", f"{T}:{path}"], capture_output=True, text=True,
                                  env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072",
                                       "OMP_NUM_THREADS": "1" if path == "sp2" else
                                       os.environ.get("OMP_NUM_THREADS", "2")})  # fmt: skip
            if proc.returncode == 0:
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                print(f"{path:8} {T:>6} tokens, {r['anchors']:>5} anchors: step {r['step_s']:7.2f} s, "
                      f"{r['step_gib']:6.2f} GiB", flush=True)  # fmt: skip
            else:
                why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:120]
                r = {"row_tokens": T, "path": path, "failed": why}
                print(f"{path:8} {T:>6} tokens: failed ({why})", flush=True)
            rows.append(r)

    def growth(path: str) -> float | None:
        got = {r["row_tokens"]: r.get("step_gib") for r in rows if r["path"] == path}
        lo, hi = got.get(16384), got.get(65536)
        return round(hi / lo, 2) if lo and hi else None

    def at_longest(path: str) -> float | None:
        return next((r.get("step_gib") for r in rows if r["path"] == path and r["row_tokens"] == top), None)

    top = max(r["row_tokens"] for r in rows)
    sp1, sp2 = at_longest("grouped"), at_longest("sp2")
    print(json.dumps({"bench": "long_context", "row_tokens": top,
                      "memory_growth_16k_to_64k": growth("grouped"), "dense_growth_16k_to_64k": growth("dense"),
                      "sp2_over_sp1_peak": round(sp2 / sp1, 3) if sp1 and sp2 else None, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
