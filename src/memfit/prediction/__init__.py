"""Memory and time, predicted before a run.

`estimator` (the analytical and traced estimates of a run's peak; what one says is
`estimate_result`), `run_shape` (the run's resolved shape, its state bytes, sharding),
`activations` (closed forms per block), `in_backward` (what is live while the optimizer steps in
backward), `encoders` and `experts` (the terms of encoder tasks
and of mixtures of experts), `layer_probe` (one block measured on fake tensors where the
closed forms do not reach), `traced` and `fake_ops` (what the traced estimate asks and
answers; the step itself runs in memfit.train.traced), `speed_model` and `calibration`
(seconds a step, corrected by what this device measured), and `planner` with `candidates`,
`plan_result` and `trade_offs` (the fastest configuration that fits, and what it trades).
Weights, gradients and optimizer state in bytes come from memfit.models.state_bytes and
memfit.models.optimizer_state, which techniques below this package use too. What a run
really used is memfit.memory.
"""
