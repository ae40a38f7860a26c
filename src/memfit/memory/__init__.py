"""Memory, measured and predicted.

Measured: `tracker` (live tensor bytes by category, phase and module, on any device),
`cap` (an emulated memory cap), `stats` (process and CUDA allocator peaks), `report` and
`plot` (what `memfit profile` shows; the profiling run is memfit.train.profiling).
Predicted: `estimator` (analytical and traced), `activations`, `traced` (with the state bytes of `memfit.models.state_bytes`),
and `planner` (the fastest configuration that fits).
"""
