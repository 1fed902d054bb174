"""llama-server's draft settings on the demo's drafter: tokens/s with each draft count
(`--spec-draft-n-max`) and minimum draft probability (`--spec-draft-p-min`) against plain
decoding, greedy, on MT-Bench's first turns and the held-out chatterbot prompts (the demo's
chat template), every output checked against plain greedy. Plain decoding runs before and after
the sweep (this machine's speed drifts): the speedup is against their mean.

    make demo && make llamacpp && .venv/bin/python bench/llamacpp_sweep.py [RUN_DIR] [--max-new 64]

Prints one row per setting, fastest first, and the fastest as the `llama-server` flags.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", nargs="?", default="runs/demo")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--prompts", type=int, default=12, help="of each set")
    p.add_argument("--n-max", default="1,2,3,4")
    p.add_argument("--p-min", default="0,0.5,0.75,0.9")
    a = p.parse_args()

    from dflash.config import load_config
    from dflash.data.chat_template import prompt_ids
    from dflash.eval.prompts import load_prompt_set
    from dflash.model.loading import load_tokenizer
    from dflash.serving import llamacpp
    from dflash.store.packages import local_path

    run = Path(a.run_dir)
    cfg = load_config(run / "config.toml")
    drafter = run / "final.gguf"
    if not drafter.is_file() or not llamacpp.server_binary().is_file():
        sys.exit(f"{drafter} or llama-server missing: make demo && make llamacpp")
    target = local_path(cfg.target.path)
    tok = load_tokenizer(cfg.target, cfg.data.cache_dir)
    kw = cfg.data.chat_template_kwargs
    sets = [load_prompt_set("mtbench"), load_prompt_set("heldout", cfg.heldout_prompts)]
    ids = [[prompt_ids(tok, t[0], kw) for t in ps.prompts[: a.prompts]] for ps in sets]
    family = json.loads((run / "final" / "config.json").read_text()).get("dflash_family", "dspark")
    ctx = max(len(x) for s in ids for x in s) + a.max_new + 32

    def rate(runs: list) -> float:
        n = sum(len(o) for r in runs for o in r.outputs)
        return n / sum(sum(len(o) for o in r.outputs) / r.tokens_per_s for r in runs if r.tokens_per_s)

    before = llamacpp.decode(target, ids, a.max_new, ctx=ctx)
    rows = []
    for n_max, p_min in itertools.product(map(int, a.n_max.split(",")), map(float, a.p_min.split(","))):
        flags = llamacpp.spec_args(drafter, family, n_max)
        flags += ["--spec-draft-p-min", f"{p_min:g}"]
        runs = llamacpp.decode(target, ids, a.max_new, flags, ctx=ctx)
        steps = sum(r.drafts for r in runs)
        tau = 1 + sum(r.accepted for r in runs) / steps if steps else 1.0
        same = all(r.outputs == b.outputs for r, b in zip(runs, before, strict=True))
        rows.append((rate(runs), n_max, p_min, tau, steps, same))
    after = llamacpp.decode(target, ids, a.max_new, ctx=ctx)
    plain = (rate(before) + rate(after)) / 2
    print(f"plain: {rate(before):.1f} tok/s before the sweep, {rate(after):.1f} after "
          f"({sum(len(p) for p in ids)} prompts, {a.max_new} tokens each)")  # fmt: skip
    print(f"{'n_max':>5} {'p_min':>5} {'tok/s':>6} {'x plain':>7} {'tau':>5} {'verify steps':>12}  lossless")
    for r, n_max, p_min, tau, steps, same in sorted(rows, reverse=True):
        print(f"{n_max:>5} {p_min:>5g} {r:>6.1f} {r / plain:>7.2f} {tau:>5.2f} {steps:>12}  {same}")
    best = max(rows)
    print(f"fastest: --spec-draft-n-max {best[1]} --spec-draft-p-min {best[2]:g} ({best[0] / plain:.2f}x plain)")


if __name__ == "__main__":
    main()
