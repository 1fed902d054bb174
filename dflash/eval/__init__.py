"""Speculative decoding of held-out prompts with a drafter and its target.

- `decode`: speculative decoding (one prompt, or a batch) and the target's own decoding,
  the lossless reference; greedy and speculative-sampling verification.
- `tally`: the `eval` record — τ, per-position acceptance, speed, the lossless check —
  over token-id or chat prompts, as `DecodeSettings` says.
- `prompts`: the prompt sets (mtbench, humaneval, heldout, a file), the run's own eval
  prompts, and the stop ids.
- `fit`: whether a drafter was trained for this target.
- `command`: `dflash eval`.
"""

from dflash.eval.command import run_eval
from dflash.eval.decode import (
    GREEDY,
    EvalStopped,
    Sampling,
    SpecOutput,
    greedy_generate,
    greedy_generate_batch,
    inference_masks,
    speculative_generate,
    speculative_generate_batch,
    verify_sampled,
)
from dflash.eval.fit import check_drafter_fits
from dflash.eval.prompts import PromptSet, eval_prompts, load_prompt_set, require_eval_prompts, stop_ids
from dflash.eval.tally import DecodeSettings, evaluate, evaluate_chat

__all__ = [
    "GREEDY",
    "DecodeSettings",
    "EvalStopped",
    "PromptSet",
    "Sampling",
    "SpecOutput",
    "check_drafter_fits",
    "eval_prompts",
    "evaluate",
    "evaluate_chat",
    "greedy_generate",
    "greedy_generate_batch",
    "inference_masks",
    "load_prompt_set",
    "require_eval_prompts",
    "run_eval",
    "speculative_generate",
    "speculative_generate_batch",
    "stop_ids",
    "verify_sampled",
]
