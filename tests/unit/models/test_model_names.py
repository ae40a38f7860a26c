"""What --model names, answered in one line: presets, directories, the Hugging Face cache, one Hub look-up.

Nothing here touches the network: the Hub's answer is replaced (`_ask_hub`, or huggingface_hub's HEAD for the
mapping of its errors), and the Hugging Face cache is a folder of the test's.
"""

from __future__ import annotations

import logging
import os
import types

import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

from memfit.config import TrainConfig
from memfit.errors import UsageError
from memfit.models import loader, model_names
from memfit.models.model_names import check_model_name

CACHED = "memfit-test/cached-llama"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hugging Face cache holding CACHED's config, the Hub online, and the look-ups recorded (answer: `hub.answer`)."""
    cache = tmp_path / "hf-cache"
    snapshot = cache / ("models--" + CACHED.replace("/", "--")) / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(model_names, "_hub_answers", {})
    state = types.SimpleNamespace(asked=[], answer="[Errno 111] Connection refused")

    def ask(hub_id):
        state.asked.append(hub_id)
        return state.answer

    monkeypatch.setattr(model_names, "_ask_hub", ask)
    monkeypatch.chdir(tmp_path)
    return state


def _refusal(name: str, **kwargs) -> str:
    with pytest.raises(UsageError) as error:
        check_model_name(name, **kwargs)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_an_unknown_name_is_refused_after_one_look_up_with_the_closest_names(hub):
    message = _refusal("llama-9000-tiny")
    assert hub.asked == ["llama-9000-tiny"]
    assert message.startswith("unknown model 'llama-9000-tiny' (did you mean tiny, ")
    assert "the Hub could not be reached ([Errno 111] Connection refused)" in message
    hub.answer = model_names._NOT_ON_HUB
    assert "the Hub has no such model" in _refusal("nobody-memfit/llama-3.1-8bb")
    assert "llama-3.1-8b" in _refusal("nobody-memfit/llama-3.1-8bb")


def test_a_name_the_hub_has_passes_and_is_asked_once_a_process(hub):
    hub.answer = None
    check_model_name("nobody-memfit/real-model")
    check_model_name("nobody-memfit/real-model", flag="--tokenizer")  # the loader's and the tokenizer's checks
    assert hub.asked == ["nobody-memfit/real-model"]
    assert not constants.HF_HUB_OFFLINE


def test_offline_refuses_without_asking(hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert "HF_HUB_OFFLINE is set" in _refusal("nobody-memfit/llama-9000-tiny")
    check_model_name(CACHED)  # the cache holds it
    assert hub.asked == []


def test_a_cached_id_loads_from_the_cache_when_the_hub_cannot_be_reached(hub, monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored after the test, as the flag below
    with caplog.at_level(logging.INFO, logger="memfit"):
        check_model_name(CACHED)
    assert hub.asked == [CACHED]
    assert constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"  # transformers asks the Hub no more
    assert [r.getMessage() for r in caplog.records if r.name == "memfit"] == [
        f"memfit: {CACHED} is read from the Hugging Face cache (the Hub could not be reached: [Errno 111] Connection"
        " refused)"]


def test_paths_presets_and_tiny_ask_nothing(hub, tmp_path):
    (tmp_path / "tiny-bert").mkdir()
    (tmp_path / "tiny-bert" / "config.json").write_text("{}")
    for name in ("tiny", "preset:llama-3.2-1b", "./tiny-bert", str(tmp_path / "tiny-bert"), "llama-3.2-1b"):
        check_model_name(name, weights=False)
    check_model_name("preset:llama-3.2-1b")
    assert hub.asked == []
    message = _refusal("./tiny-bret")
    assert "model path ./tiny-bret does not exist (did you mean ./tiny-bert" in message
    assert "did you mean llama-3.2-1b" in _refusal("preset:llama-3.2-1bb")


def test_a_preset_short_name_loads_its_hub_weights(hub):
    message = _refusal("llama-3.2-1b")  # with weights (train): meta-llama/Llama-3.2-1B, neither cached nor reachable
    assert hub.asked == ["meta-llama/Llama-3.2-1B"]
    assert "--model preset:llama-3.2-1b trains one of its shape from random weights" in message


def test_estimate_refuses_a_bare_unknown_name_at_once(hub):
    message = _refusal("llama-3.1-8bb", weights=False)
    assert "did you mean llama-3.1-8b" in message and hub.asked == []
    assert "valid Hugging Face id" in _refusal("not a/valid id")
    assert hub.asked == []


def _response(status: int):
    return types.SimpleNamespace(headers={}, status_code=status, request=None)


@pytest.mark.parametrize("raised, answer", [
    (None, None),
    (GatedRepoError("gated", response=_response(403)), None),
    (RepositoryNotFoundError("404", response=_response(404)), model_names._NOT_ON_HUB),
    (HfHubHTTPError("500", response=_response(500)), None),
    (OSError("[Errno -2] Name or service not known"), "[Errno -2] Name or service not known"),
], ids=["exists", "gated", "not-found", "server-error", "no-network"])
def test_the_look_up_is_one_head_without_retries(raised, answer, monkeypatch):
    import huggingface_hub

    calls = []

    def head(url, timeout=10, retry_on_errors=True):  # huggingface_hub's signature: the loader reads it
        calls.append((url, {"timeout": timeout, "retry_on_errors": retry_on_errors}))
        if raised is not None:
            raise raised

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", head)
    assert model_names._ask_hub("nobody-memfit/model") == answer
    (url, kwargs), = calls
    assert url.endswith("nobody-memfit/model/resolve/main/config.json")
    assert kwargs == {"timeout": model_names.HUB_LOOKUP_TIMEOUT_S, "retry_on_errors": False}


@pytest.fixture
def load_reports():
    """The LOAD REPORT records transformers' modeling logger passes on (to its handlers: stderr by default)."""
    reports: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            if "LOAD REPORT" in record.getMessage():
                reports.append(record.getMessage())

    handler = Collect()
    modeling = logging.getLogger("transformers.modeling_utils")
    modeling.addHandler(handler)
    yield reports
    modeling.removeHandler(handler)


def test_a_new_head_is_one_line_of_memfit_and_no_load_report(tmp_path, caplog, load_reports):
    from transformers import AutoModelForSequenceClassification

    from tiny_encoders import save_encoder

    directory = save_encoder(tmp_path / "bert")
    config = TrainConfig()
    attention = types.SimpleNamespace(implementation="sdpa", hf_name="sdpa")
    head = loader._HeadClass(AutoModelForSequenceClassification, {"num_labels": 3})
    with caplog.at_level(logging.DEBUG, logger="memfit"):
        model = loader._from_pretrained(str(directory), config, torch.float32, attention, None, auto_class=head)
    assert type(model).__name__ == "BertForSequenceClassification"
    assert load_reports == []
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "memfit"]
    assert lines == [(logging.INFO, f"memfit: weights newly initialised (not in {directory}; --seed"
                      f" {config.training.seed}): bert.pooler.dense, classifier; left unused from it: cls.predictions"
                      " (5 tensors)")]


def test_a_load_that_fails_shows_the_report_it_points_to(tmp_path, load_reports):
    from transformers import AutoModelForMaskedLM

    from tiny_encoders import bert_config, save_encoder

    directory = save_encoder(tmp_path / "bert")
    other = bert_config(hidden=64)  # every weight of another shape: transformers raises, pointing to its report
    attention = types.SimpleNamespace(implementation="sdpa", hf_name="sdpa")
    with pytest.raises(RuntimeError, match="above report"):
        loader._from_pretrained(str(directory), TrainConfig(), torch.float32, attention, None, hf_config=other,
                                auto_class=AutoModelForMaskedLM)
    assert len(load_reports) == 1 and "MISMATCH" in load_reports[0]


def test_missing_weights_of_a_causal_lm_are_a_warning_and_unused_ones_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="memfit"):
        loader._say_new_weights("m", {"missing_keys": {"lm_head.weight"}, "unexpected_keys": set()}, 0, expected=False)
        loader._say_new_weights("m", {"missing_keys": set(), "unexpected_keys": {"rotary.inv_freq"}}, 0, expected=False)
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "memfit"] == [
        (logging.WARNING, "memfit: weights newly initialised (not in m; --seed 0): lm_head"),
        (logging.DEBUG, "memfit: weights left unused from m: rotary.inv_freq (1 tensor)")]


def test_the_cli_quiets_huggingface_hubs_retry_notices(capsys):
    from memfit.cli.main import main

    assert main(["presets", "gpus"]) == 0
    capsys.readouterr()
    assert logging.getLogger("huggingface_hub.utils._http").getEffectiveLevel() == logging.ERROR
