"""One key per model config for the caches of what a config's modules hold (parameter shapes, probed block bytes).

The key is the config's JSON (`to_json_string(use_diff=False)`), without `use_cache`: `memfit train`'s loader
turns the KV cache off on the loaded config (models/loader.py) while `memfit estimate` reads the config as
saved, and no module, shape or saved activation depends on it (a training forward never fills a cache), so with
it in the key the same model was built and probed twice in one process.

Serialising a config deep-copies its attributes (about 0.5 ms for Llama-3.1-8B's); the planner asks for the key
of the same config in each of its tens of thousands of estimates. The JSON is therefore kept per state of the
config: the `repr` of its attributes (nested dicts and lists included, so a change made in place shows; a
sub-config's repr is its JSON), which costs a small fraction of the serialisation. Two configs of one class whose
attributes print alike serialise alike.
"""

from __future__ import annotations

import json
from typing import Any

IGNORED = ("use_cache",)
"""Attributes that change no module, shape or saved activation of a training step."""

_JSON_BY_STATE: dict[tuple[type, str], str] = {}
_MAX_STATES = 4096  # a long planner search meets a few configs; the bound only guards a library user's loop


def config_key(hf_config: Any) -> str:
    """The config's JSON without the attributes of `IGNORED`: equal for configs that build the same modules."""
    attributes = vars(hf_config)
    state = (type(hf_config), repr(sorted((name, value) for name, value in attributes.items()
                                          if name not in IGNORED)))
    key = _JSON_BY_STATE.get(state)
    if key is None:
        data = json.loads(hf_config.to_json_string(use_diff=False))
        for name in IGNORED:
            data.pop(name, None)
        key = json.dumps(data, sort_keys=True)
        if len(_JSON_BY_STATE) >= _MAX_STATES:
            _JSON_BY_STATE.clear()
        _JSON_BY_STATE[state] = key
    return key
