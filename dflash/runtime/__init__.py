"""What a run executes on, below the step's math and the pipeline alike: devices (a worker
thread and CUDA streams each, the named host syncs), several processes (`distributed`),
timing (`profiler`), fault injection, channels, and the messages that travel between stages.
It knows nothing of drafters, losses or stages' order."""
