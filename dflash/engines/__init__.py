"""The engines dflash drives, as libraries: what every user of vLLM in dflash shares (`vllm`:
found or refused, opened with a sized KV cache, run on the right runner, shut down). Who uses
them lives by concern: `dflash/regen/` (replies), `dflash/features/vllm.py` (the target's
features), `dflash/targets/` (a live or remote target), `dflash/serving/` (an export decoded in
vLLM and llama.cpp)."""
