"""`dflash regen`: the target writes the assistant turns of a prompt set (self-distillation).

`command` is the command's flow (prompts, held-out split, resume, order, records) and picks
who answers (`open_replier`); `replier` is the face every replier shows; one module per
replier, named for its engine: `local` (the target's own generate loop), `vllm` (vLLM's
offline API in this process), `server` (an OpenAI-compatible chat server).
"""

from dflash.regen.command import open_replier, regenerate, write_jsonl

__all__ = ["open_replier", "regenerate", "write_jsonl"]
