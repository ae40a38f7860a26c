"""Memory, measured and predicted.

Measured: `tracker` (live tensor bytes by category, phase and module, on any device),
`cap` (an emulated memory cap), `stats` (process and CUDA allocator peaks), `report`,
`plot` and `profile` (what `memfit profile` shows).
Predicted: `estimator` (analytical and traced), `activations`, `state_bytes`, `traced`,
and `planner` (the fastest configuration that fits).
"""
