"""memfit: train and fine-tune causal language models within the memory you have.

Library entry points:

    from memfit import TrainConfig, load_config, train
    result = train(load_config(overrides={"max_steps": 10}))
"""

import memfit.train as _train_package  # noqa: F401  (see train() below)
from memfit.config import TrainConfig
from memfit.config_loading import load_config

__all__ = ["TrainConfig", "load_config", "train", "estimate", "plan"]
__version__ = "0.1.0"


def train(config: TrainConfig, **kwargs):
    """Train as `config` says and return a TrainResult (memfit.train.loop.train; keyword arguments pass through).

    As `memfit train` does, a `memory_budget` or `gpu` plans the configuration first and
    `auto_batch_size` probes the micro-batch first (memfit.train.planned).

    A function here rather than a lazy attribute: the package memfit.train is loaded above (it imports nothing
    heavy) so that importing one of its modules later cannot rebind the name `memfit.train` to the package.
    """
    from memfit.train.loop import train as run_training
    from memfit.train.planned import decide_before_training

    return run_training(decide_before_training(config), **kwargs)


def __getattr__(name: str):
    # Heavy modules (torch, transformers) load only when these are used.
    if name == "estimate":
        import memfit.train.traced  # noqa: F401  (registers the step method="traced" runs)
        from memfit.memory.estimator import estimate

        return estimate
    if name == "plan":
        from memfit.memory.planner import plan

        return plan
    raise AttributeError(name)
