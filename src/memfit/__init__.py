"""memfit: train and fine-tune causal language models within the memory you have.

Library entry points:

    from memfit import TrainConfig, load_config, train
    result = train(load_config(overrides={"max_steps": 10}))
"""

from memfit import train  # the package memfit.train, callable: train(config) (see its __init__)
from memfit.config import TrainConfig
from memfit.config_loading import load_config

__all__ = ["TrainConfig", "load_config", "train", "estimate", "plan"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Heavy modules (torch, transformers) load only when these are used.
    if name == "estimate":
        import memfit.train.traced  # noqa: F401  (registers the step method="traced" runs)
        from memfit.prediction.estimator import estimate

        return estimate
    if name == "plan":
        from memfit.prediction.planner import plan

        return plan
    raise AttributeError(name)
