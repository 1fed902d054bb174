"""A drafter's training step with the whole vocabulary against draft vocabularies
(`drafter.draft_vocab_size`): step time (prepare + forward + loss + backward + AdamW) and the
process's peak memory, random weights, at the demo's shape (SmolLM2-135M's 576 × 49,152 head,
a 1-layer DSpark drafter) and at a Qwen3-8B-shaped one (4,096 × 151,936, 1 DFlash layer).

    .venv/bin/python bench/draft_vocab_step.py                       # both shapes, CPU
    .venv/bin/python bench/draft_vocab_step.py --shape qwen3-8b --sizes 0,32768,8192 --steps 3
    .venv/bin/python bench/draft_vocab_step.py --device cuda         # on a GPU: peak = max_memory_allocated

Each (shape, size) runs in its own process; its peak is the process's RSS high-water mark over the
timed steps (reset after set-up), and how far that lies above the RSS before them (the step's own
memory: activations, logits, gradients, AdamW's state). The labels are drawn from
a Zipf law over the vocabulary, so a draft vocabulary of the most frequent tokens holds most of
them, as on real replies. The first step (allocation, warm-up) is not timed. Prints a table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # hidden, heads, kv heads, head dim, intermediate, vocabulary, family, rows, row length, anchors, block
    "demo": dict(H=576, heads=9, kv=3, hd=64, inter=1536, V=49152, family="dspark", R=8, T=256, N=8, B=4),
    "tiny": dict(H=64, heads=4, kv=2, hd=16, inter=128, V=512, family="dspark", R=2, T=64, N=4, B=4),  # the tests'
    "qwen3-8b": dict(H=4096, heads=32, kv=8, hd=128, inter=12288, V=151936, family="dflash", R=1, T=512, N=16, B=16),
}


def status_gib(key: str) -> float:
    """This process's `VmRSS` (now) or `VmHWM` (its peak since the last reset), GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def one(shape: str, size: int, steps: int, device: str) -> dict:
    import torch

    from dflash.config import OptimizerConfig
    from dflash.model.drafter import DrafterSpec, FrozenHead
    from dflash.model.loss import LossSpec
    from dflash.model.vocab import DraftVocab
    from dflash.runtime.devices import Device
    from dflash.runtime.messages import Batch, HostFeatures
    from dflash.train.replicas import build_replicas
    from dflash.train.step import MicroStep

    s = SHAPES[shape]
    H, V, R, T, B = s["H"], s["V"], s["R"], s["T"], s["B"]
    family = {"markov_rank": 64, "confidence_head": True} if s["family"] == "dspark" else {}
    spec = DrafterSpec(
        hidden_size=H, num_layers=1, num_heads=s["heads"], num_kv_heads=s["kv"], head_dim=s["hd"],
        intermediate_size=s["inter"], vocab_size=V, rms_norm_eps=1e-6, rope_theta=1e6, target_layer_ids=[1],
        num_target_layers=4, block_size=B, mask_token_id=V - 1, layer_types=["full_attention"], sliding_window=T,
        family=s["family"], draft_vocab_size=size if size < V else 0, **family,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    zipf = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
    order = torch.randperm(V, generator=g)  # the frequent tokens are anywhere in the vocabulary
    weights = torch.zeros(V, dtype=torch.float64).index_copy_(0, order, zipf)
    vocab = DraftVocab.most_frequent((weights * 1e9).long(), size) if size and size < V else None
    w = torch.randn(V, H, generator=g) * 0.02  # a tied head: the embedding is the head
    dev = torch.device(device)
    rep = build_replicas(spec, FrozenHead(w, w), [dev], OptimizerConfig(), lambda _: 1.0, 0, None, vocab)[0]
    del w
    ids = torch.multinomial(weights.float(), R * T, replacement=True, generator=g).view(R, T)
    mask = torch.ones(R, T, dtype=torch.bool)
    mask[:, : T // 4] = False  # a prompt, then the reply
    batch = Batch(0, 0, ids, mask, torch.zeros(R, T, dtype=torch.long), torch.arange(T).expand(R, T).contiguous(),
                  R * T, R, False)  # fmt: skip
    feats = HostFeatures(batch, torch.randn(R, T, H, generator=g), 0)
    micro = MicroStep(LossSpec(block_size=B, shift=1 if s["family"] == "dspark" else 0), max_anchors=s["N"])
    device = Device(device, "d")
    times, losses = [], []
    before = status_gib("VmRSS")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:  # the peak RSS from here on (Linux: the high-water mark reset)
        Path("/proc/self/clear_refs").write_text("5")
    for step in range(steps + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        prepared = micro.prepare(rep, device, feats, step)
        parts = micro.compute(rep, device, prepared)
        rep.optimizer.step()
        rep.optimizer.zero_grad(set_to_none=True)
        loss = float(parts.loss_sum) / parts.weight_sum  # sync: the step's end
        if step:
            times.append(time.perf_counter() - t0)
        losses.append(loss)
    device.close()
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else status_gib("VmHWM")
    covered = 1.0 if vocab is None else float(vocab.t2d[ids[mask]].float().mean())
    return {"shape": shape, "draft_vocab_size": size or V, "step_s": statistics.median(times), "peak_gib": peak,
            "steps_above_gib": peak - (0.0 if dev.type == "cuda" else before),
            "head_rows": size or V, "labels_covered": covered, "supervised_slots": int(prepared.targets.sel.numel()),
            "loss": losses[-1]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="demo,qwen3-8b")
    p.add_argument("--sizes", default="0,32768,8192,4096", help="0: the whole vocabulary")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--one", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        shape, size = a.one.split(":")
        print(json.dumps(one(shape, int(size), a.steps, a.device)))
        return
    rows = []
    for shape in a.shape.split(","):
        for size in map(int, a.sizes.split(",")):
            if size >= SHAPES[shape]["V"]:
                continue
            cmd = [sys.executable, __file__, "--one", f"{shape}:{size}", "--steps", str(a.steps), "--device", a.device]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            r = rows[-1]
            whole = next(x for x in rows if x["shape"] == shape)
            speedup = whole["step_s"] / r["step_s"]
            print(f"{shape:9} V'={r['draft_vocab_size']:>7}  step {r['step_s']:7.3f} s ({speedup:4.2f}×)"
                  f"  peak {r['peak_gib']:6.2f} GiB ({r['steps_above_gib']:5.2f} for the steps)"
                  f"  labels in V' {r['labels_covered']:.3f}"
                  f"  slots {r['supervised_slots']}", flush=True)  # fmt: skip
    print(json.dumps({"device": a.device, "rows": rows}))


if __name__ == "__main__":
    main()
