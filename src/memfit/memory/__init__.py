"""Memory, measured and predicted.

Measured: `live_storage` (the one counter of live tensor storages: weak, resize-aware,
device vs host, the emulated cap of `cap`), `tracker` (built on it: categories from
`categories`, phases and peaks in `peaks`, module attribution in `modules`), `stats`
(process and CUDA allocator peaks), `report`, `advice` and `plot` (what `memfit profile`
shows; the profiling run is memfit.train.profiling).
Predicted: `estimator` (analytical and traced), `activations`, `layer_probe`, `traced`
(what the traced estimate asks and answers; the step itself runs in memfit.train.traced),
with the state bytes of `memfit.models.state_bytes`, and `planner` (the fastest
configuration that fits).
"""
