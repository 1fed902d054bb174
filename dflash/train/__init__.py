"""What a run computes: `build` turns a config into a `Training`; `step` is one optimizer
step's math, top to bottom (prepare → forward → loss → backward → update); `reduce` moves
the gradients between replicas and ranks and holds the step's one host sync; `replicas` and
`schedule` hold the drafters, their learning rate and the time budget; `hooks` what runs
between steps; `checkpoint` saving and resuming. It never imports the pipeline that drives it."""
