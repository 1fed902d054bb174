"""Targets whose decoder layers run outside the pipeline's target stage: a live vLLM engine in
this process (`live`, `target.engine = "vllm"`) and a `dflash serve-target` elsewhere through a
spool folder (`target.engine = "remote"`: its protocol, the trainer's client and the engine's
server, `spool_protocol`, `spool_client`, `spool_server`). The run loads the target's head
only; `train/build.py` wraps it in one of these."""
