"""Memory and time, predicted before a run.

`estimator` (the analytical and traced estimates of a run's peak, with the run's resolved
shape in `run_shape`), `activations` (closed forms per block) and `layer_probe` (one
block measured on fake tensors where the closed forms do not reach), `traced` (what the
traced estimate asks and answers; the step itself runs in memfit.train.traced),
`speed_model` (seconds a step), and `planner` with `candidates` and `plan_messages` (the
fastest configuration that fits, and what it trades). Weights, gradients and optimizer
state in bytes come from memfit.models.state_bytes and memfit.models.optimizer_state, which
techniques below this package use too. What a run really used is memfit.memory.
"""
