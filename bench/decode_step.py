"""What one speculative step costs in dflash's own decoding (torch, one prompt at a time, greedy),
part by part, for a run's drafter as trained and cut to smaller draft vocabularies: the target's
verification of the block and its features, the drafter's context encoding (fc + the new
positions' keys and values), its block forward (the layer), the head and the family's drafting
(DSpark's Markov chain), against a plain target token.

    .venv/bin/python bench/decode_step.py [RUN_DIR] [--vocab 0,8192,4096] [--prompts 6]

`--vocab`: 0 is the drafter as trained; other sizes cut it (`DFlashDrafter.restricted`) to the
most frequent tokens of its run's map (a whole-vocabulary drafter: of its training data, cut with
the target's head). Each part is timed around its call (CPU: no asynchronous work in between);
"head" is the LM-head matmul alone at the drafted positions, timed apart, and "drafting" the
rest of the proposal (the Markov chain or the selector walk). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", nargs="?", default="runs/demo")
    p.add_argument("--vocab", default="0,4096,2048")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new", type=int, default=64)
    a = p.parse_args()

    import torch

    import dflash.eval.decode as decode
    from dflash.config import load_config
    from dflash.data.chat_template import prompt_ids
    from dflash.eval.prompts import load_prompt_set, stop_ids
    from dflash.model.drafter import FrozenHead
    from dflash.model.export import load_drafter
    from dflash.model.loading import load_tokenizer
    from dflash.model.target import load_target
    from dflash.model.vocab import FILE, DraftVocab, count_supervised

    torch.set_grad_enabled(False)
    run = Path(a.run_dir)
    cfg = load_config(run / "config.toml")
    tok = load_tokenizer(cfg.target, cfg.data.cache_dir)
    target_cfg = cfg.target.model_copy(update={"dtype": cfg.eval.target_dtype or cfg.target.dtype})
    target = load_target(target_cfg, torch.device("cpu"), cfg.drafter.num_layers, cfg.data.cache_dir)
    drafter = load_drafter(run / "final").eval()
    head = FrozenHead(target.embed_weight, target.lm_head_weight).to(torch.device("cpu"), torch.float32)
    V = drafter.spec.vocab_size
    if (run / FILE).is_file():
        freqs = DraftVocab.load(run / FILE, V).freqs
    else:
        from dflash.train.build import _samples

        freqs = count_supervised(_samples(cfg, target, tok, drafter.spec.mask_token_id, lambda _: None)[0], V)
    prompts = [torch.tensor(prompt_ids(tok, t[0], cfg.data.chat_template_kwargs))
               for t in load_prompt_set("mtbench").prompts[: a.prompts]]  # fmt: skip
    stops = stop_ids(target, tok)

    spent: dict[str, list[float]] = defaultdict(list)

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name].append(time.perf_counter() - t0)
            return out

        return call

    S = decode._Speculation
    originals = (S.extend, S.draft, S.verify, decode.propose)
    S.extend, S.draft, S.verify = timed("context", S.extend), timed("layer", S.draft), timed("verify", S.verify)
    decode.propose = timed("propose", decode.propose)

    t0 = time.perf_counter()
    plain_tokens = sum(len(decode.greedy_generate(target, p, a.max_new, stops)) for p in prompts)
    plain_ms = 1000 * (time.perf_counter() - t0) / plain_tokens
    rows = []
    for size in map(int, a.vocab.split(",")):
        d = drafter if size == 0 else drafter.restricted(
            DraftVocab.most_frequent(freqs, size, [drafter.spec.mask_token_id]).ids, head.lm_head)  # fmt: skip
        spent.clear()
        t0 = time.perf_counter()
        outs = [decode.speculative_generate(target, d, head, p, a.max_new, stops) for p in prompts]
        wall = time.perf_counter() - t0
        steps = sum(len(o.accepted) for o in outs)
        tokens = sum(len(o.tokens) for o in outs)
        # the head alone at the drafted positions, timed apart
        n, H = d.spec.drafts, d.spec.hidden_size
        h, w = torch.randn(1, n, H), d.drafting_head(head.lm_head)
        torch.nn.functional.linear(h, w)
        reps = 50
        t1 = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(h, w)
        head_ms = 1000 * (time.perf_counter() - t1) / reps
        per = {k: 1000 * sum(v) / steps for k, v in spent.items()}
        per["context"] = 1000 * sum(spent["context"][len(prompts):]) / steps  # the prompts' prefill left out
        per["head"] = head_ms
        per["drafting"] = per.pop("propose") - head_ms
        per["step"] = 1000 * wall / steps
        rows.append({"draft_vocab": d.spec.draft_vocab_size or V, "tau": tokens / steps, "ms": per,
                     "x_plain": plain_ms * tokens / steps / per["step"]})  # fmt: skip
    S.extend, S.draft, S.verify, decode.propose = originals
    print(f"plain: {plain_ms:.2f} ms a token ({plain_tokens} tokens)")
    print(f"{'vocab':>6} {'tau':>5} {'step':>6} {'verify':>6} {'context':>7} {'layer':>6} {'head':>6} {'drafting':>8}"
          f" {'x plain':>7}")  # fmt: skip
    for r in rows:
        m = r["ms"]
        print(f"{r['draft_vocab']:>6} {r['tau']:>5.2f} {m['step']:>6.2f} {m['verify']:>6.2f} {m['context']:>7.2f} "
              f"{m['layer']:>6.2f} {m['head']:>6.2f} {m['drafting']:>8.2f} {r['x_plain']:>7.2f}")  # fmt: skip
    print(json.dumps({"plain_ms": plain_ms, "rows": rows}))


if __name__ == "__main__":
    main()
