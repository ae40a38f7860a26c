"""Memory as measured.

`live_storage` (the one counter of live tensor storages: weak, resize-aware, device vs host,
the emulated cap of `cap`), `tracker` (built on it: categories from `categories`, phases and
peaks in `peaks`, module attribution in `modules`), `stats` (process and CUDA allocator
peaks), `report`, `advice` and `plot` (what `memfit profile` shows; the profiling run is
memfit.train.profiling). What a run will need, before it runs, is memfit.prediction.
"""
