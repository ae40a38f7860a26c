"""Training: `setup` builds a run, `loop` drives it, `step` runs one optimizer step with
exact accumulation and OOM recovery, `checkpoint` saves and resumes, `metrics` and
`progress` report, `batch_size` finds the largest micro-batch that fits."""
