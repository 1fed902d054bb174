"""The demo's drafter in llama-server: what a speculative step costs, and tokens/s for each draft
vocabulary × draft count (`--spec-draft-n-max`) × minimum draft probability
(`--spec-draft-p-min`) against plain decoding, greedy, on MT-Bench's first turns and the
held-out chatterbot prompts (the demo's chat template), every output checked against plain.

    make demo && make llamacpp && .venv/bin/python bench/llamacpp_sweep.py [RUN_DIR]
    .venv/bin/python bench/llamacpp_sweep.py runs/demo --vocab 8192,4096,2048 --n-max 1,2,4 --p-min 0,0.9

Smaller draft vocabularies are the run's drafter cut to the most frequent tokens of its own map
(`DFlashDrafter.restricted`: the same weights, fewer head rows); a drafter trained on the whole
vocabulary is cut with the target's head. Parts:

1. costs: plain ms a token; the target verifying k + 1 tokens (a cached prompt extended by
   k + 1 tokens, llama-server's own prompt timing, median of 15); each vocabulary's drafting
   step (ms a token at p_min 0.99, where nothing is drafted, minus the plain runs on both sides;
   median of `--cost-repeats`; at 4 and 1 drafts); and the τ each draft count needs to break
   even: (verify(k + 1) + drafting step) / plain token.
2. the sweep: each setting between two plain runs (this machine's speed drifts ±15 %); its
   speed against their mean.
3. the fastest setting again `--repeats` times, alternating with plain: the median.

Run it alone: on two cores a second busy process slows llama.cpp's threads many times over.
Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rate(runs: list) -> float:
    """Generated tokens over generation time, over every set (llama-server's own timings)."""
    n = sum(len(o) for r in runs for o in r.outputs)
    return n / sum(sum(len(o) for o in r.outputs) / r.tokens_per_s for r in runs if r.tokens_per_s)


def _drafters(run: Path, sizes: list[int], out: Path, gtype: str) -> dict[int, Path]:
    """The run's drafter as GGUF at each draft vocabulary size (0: as trained)."""
    import torch

    from dflash.config import load_config
    from dflash.model.export import load_drafter
    from dflash.model.export_gguf import read_target_gguf, write_gguf
    from dflash.model.loading import load_tokenizer
    from dflash.model.vocab import FILE, DraftVocab, count_supervised
    from dflash.serving import llamacpp

    cfg = load_config(run / "config.toml")
    drafter = load_drafter(run / "final")
    V = drafter.spec.vocab_size
    vocab_gguf = read_target_gguf(llamacpp.target_vocab(cfg.target.kind, cfg.target.path, cfg.data.cache_dir))
    tok = load_tokenizer(cfg.target, cfg.data.cache_dir)
    head = None
    if (run / FILE).is_file():
        freqs = DraftVocab.load(run / FILE, V).freqs
    else:  # a drafter over the whole vocabulary: count the replies, cut with the target's head
        from dflash.model.target_head import load_target_head
        from dflash.train.build import _samples  # the run's samples, as training read them

        target = load_target_head(cfg.target, torch.device("cpu"), cfg.drafter.num_layers, cfg.data.cache_dir)
        head = target.lm_head_weight.float()
        samples, _ = _samples(cfg, target, tok, drafter.spec.mask_token_id, lambda _: None)
        freqs = count_supervised(samples, V)
    assert freqs is not None
    keep = [drafter.spec.mask_token_id, *([tok.eos_token_id] if tok.eos_token_id is not None else [])]  # as training
    paths = {}
    for size in sizes:
        cut = drafter if size in (0, drafter.spec.draft_vocab_size or V) else drafter.restricted(
            DraftVocab.most_frequent(freqs, size, keep).ids, head)  # fmt: skip
        paths[size or cut.spec.draft_vocab_size or V] = write_gguf(
            cut.spec, cut.state_dict(), vocab_gguf, out / f"drafter-{size}.gguf", gtype)
    return paths


def _verify_ms(target: Path, prompt: list[int], extra: list[int], reps: int) -> list[float]:
    """The target's prompt time for k + 1 = 1..5 tokens after a cached prompt (median of `reps`)."""
    from dflash.serving import llamacpp

    out = []
    with llamacpp.Server(target, ctx=1024) as server:
        for k in range(1, 6):
            times = []
            for _ in range(reps):
                server._call("POST", "/completion", json={"prompt": prompt, "n_predict": 0, "cache_prompt": True})
                o = server._call("POST", "/completion", json={"prompt": prompt + extra[:k], "n_predict": 1,
                                                              "cache_prompt": True, "temperature": 0.0})  # fmt: skip
                times.append(float(o["timings"]["prompt_ms"]))  # type: ignore[index]
            out.append(statistics.median(times))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", nargs="?", default="runs/demo")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--prompts", type=int, default=6, help="of each set")
    p.add_argument("--vocab", default="0,4096,2048", help="draft vocabulary sizes; 0: the drafter's own")
    p.add_argument("--n-max", default="1,2,4")
    p.add_argument("--p-min", default="0,0.9")
    p.add_argument("--repeats", type=int, default=3, help="the fastest setting again, alternating with plain")
    p.add_argument("--gguf-type", default="f16")
    p.add_argument("--cost-repeats", type=int, default=3, help="plain / idle-drafter pairs per drafting step cost")
    p.add_argument("--costs-only", action="store_true", help="part 1 only")
    a = p.parse_args()

    from dflash.config import load_config
    from dflash.data.chat_template import prompt_ids
    from dflash.eval.prompts import load_prompt_set
    from dflash.model.loading import load_tokenizer
    from dflash.serving import llamacpp
    from dflash.store.packages import local_path

    run = Path(a.run_dir)
    cfg = load_config(run / "config.toml")
    if not (run / "final").is_dir() or not llamacpp.server_binary().is_file():
        sys.exit(f"{run / 'final'} or llama-server missing: make demo && make llamacpp")
    target = local_path(cfg.target.path)
    tok = load_tokenizer(cfg.target, cfg.data.cache_dir)
    kw = cfg.data.chat_template_kwargs
    sets = [load_prompt_set("mtbench"), load_prompt_set("heldout", cfg.heldout_prompts)]
    ids = [[prompt_ids(tok, t[0], kw) for t in ps.prompts[: a.prompts]] for ps in sets]
    family = json.loads((run / "final" / "config.json").read_text()).get("architectures", [""])[0]
    family = "dspark" if "DSpark" in family else "dflash"
    ctx = max(len(x) for s in ids for x in s) + a.max_new + 32
    tmp = Path(tempfile.mkdtemp(prefix="dflash-sweep-"))
    drafters = _drafters(run, [int(v) for v in a.vocab.split(",")], tmp, a.gguf_type)

    def plain() -> list:
        return llamacpp.decode(target, ids, a.max_new, ctx=ctx)

    def drafted(vocab: int, n_max: int, p_min: float) -> list:
        flags = [*llamacpp.spec_args(drafters[vocab], family, n_max), "--spec-draft-p-min", f"{p_min:g}"]
        return llamacpp.decode(target, ids, a.max_new, flags, ctx=ctx)

    # 1. costs
    flat = [t for s in ids for t in s]
    verify = _verify_ms(target, (flat[0] + flat[1])[:100], flat[2][:8], reps=15)
    base = plain()
    plains = [1000 / _rate(base)]
    step = {}
    for vocab, n_max in itertools.product(drafters, (4, 1)):
        diffs = []
        for _ in range(a.cost_repeats):  # each idle-drafter run against the plain runs on both sides of it
            idle = 1000 / _rate(drafted(vocab, n_max, 0.99))
            plains.append(1000 / _rate(plain()))
            diffs.append(idle - (plains[-2] + plains[-1]) / 2)
        step[vocab, n_max] = statistics.median(diffs)
    plain_ms = statistics.median(plains)
    print(f"plain: {plain_ms:.2f} ms a token; the target verifying k+1 = 1..5 tokens: "
          + ", ".join(f"{v:.2f}" for v in verify) + " ms")  # fmt: skip
    print(f"{'vocab':>6} {'drafts':>6} {'step ms':>7}  τ to break even at k = 1, 2, 4")
    for (vocab, n_max), ms in step.items():
        need = [(verify[k] + ms) / plain_ms for k in (1, 2, 4)]
        print(f"{vocab:>6} {n_max:>6} {ms:>7.2f}  " + " ".join(f"{x:.2f}" for x in need))

    costs = {f"{v}:{n}": ms for (v, n), ms in step.items()}
    if a.costs_only:
        print(json.dumps({"plain_ms": plain_ms, "verify_ms": verify, "step_ms": costs}))
        return

    # 2. the sweep, each setting between plain runs
    rows = []
    last = base
    grid = itertools.product(drafters, map(int, a.n_max.split(",")), map(float, a.p_min.split(",")))
    for vocab, n_max, p_min in grid:
        runs = drafted(vocab, n_max, p_min)
        after = plain()
        ref = (_rate(last) + _rate(after)) / 2
        last = after
        steps = sum(r.drafts for r in runs)
        tau = 1 + sum(r.accepted for r in runs) / steps if steps else 1.0
        same = all(r.outputs == b.outputs for r, b in zip(runs, base, strict=True))
        rows.append({"vocab": vocab, "n_max": n_max, "p_min": p_min, "tok_s": _rate(runs), "x_plain": _rate(runs) / ref,
                     "tau": tau, "verify_steps": steps, "lossless": same})  # fmt: skip
    print(f"{'vocab':>6} {'n_max':>5} {'p_min':>5} {'tok/s':>6} {'x plain':>7} {'tau':>5} {'steps':>6}  lossless")
    for r in sorted(rows, key=lambda r: -r["x_plain"]):
        print(f"{r['vocab']:>6} {r['n_max']:>5} {r['p_min']:>5g} {r['tok_s']:>6.1f} {r['x_plain']:>7.2f} "
              f"{r['tau']:>5.2f} {r['verify_steps']:>6}  {r['lossless']}")  # fmt: skip

    # 3. the fastest again, alternating with plain
    best = max(rows, key=lambda r: r["x_plain"])
    ratios = []
    for _ in range(a.repeats):
        before, runs = plain(), drafted(best["vocab"], best["n_max"], best["p_min"])
        ratios.append(_rate(runs) / ((_rate(before) + _rate(plain())) / 2))
    median = statistics.median(ratios)
    print(f"fastest: vocabulary {best['vocab']}, --spec-draft-n-max {best['n_max']} --spec-draft-p-min "
          f"{best['p_min']:g}: {median:.2f}x plain (median of {a.repeats}: {', '.join(f'{x:.2f}' for x in ratios)})")
    print(json.dumps({"plain_ms": plain_ms, "verify_ms": verify, "step_ms": costs,
                      "rows": rows, "best": best, "best_median_x_plain": median, "repeats": ratios}))  # fmt: skip


if __name__ == "__main__":
    main()
