"""What a run computes: `build` turns a config into a `Training`, `step` is one optimizer
step's math (prepare → forward → loss → backward → update), `replicas` and `schedule` hold
the drafters and their learning rate, `hooks` what runs between steps, `checkpoint` saving
and resuming. It never imports the pipeline that drives it."""
