"""Training: `setup` builds a run, `engine` says where its steps run (one process here; DDP, FSDP2
and DeepSpeed in memfit.distributed), `step` runs one optimizer step with exact accumulation and
OOM recovery, `loop` drives the steps, `metrics`, `progress` and `run_summary` report,
`batch_size` finds the largest micro-batch that fits, `profiling` runs `memfit profile`.
See docs/architecture.md."""

import sys
import types


class _CallablePackage(types.ModuleType):
    """`memfit.train` is this package and also the library's train function.

    Python binds a loaded submodule as an attribute of its parent, so after any
    `memfit.train.*` import the name `memfit.train` is this package whatever memfit's
    __init__ defined; making the package callable keeps `from memfit import train;
    train(config)` and `import memfit.train.loop as loop` both working.
    """

    def __call__(self, config, **kwargs):
        """Train as `config` says and return a TrainResult (memfit.train.loop.train; keyword arguments pass through).

        As `memfit train` does, a `memory_budget` or `gpu` plans the configuration first and
        `auto_batch_size` probes the micro-batch first (memfit.train.planned).
        """
        from memfit.train.loop import train as run_training
        from memfit.train.planned import decide_before_training

        return run_training(decide_before_training(config), **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
