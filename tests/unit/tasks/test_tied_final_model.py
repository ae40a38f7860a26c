"""A masked LM saved from a gathered state dict (FSDP2's full state dict on the CPU, one copy per name) has the
names one process writes: the decoder weight and bias stay tied to the embedding and the bias, not written twice."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import BertForMaskedLM

from memfit.checkpoint_files import save_final_model, share_tied_tensors
from tiny_encoders import bert_config


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a full state dict gathered to the CPU looks like: every name its own tensor."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_a_gathered_state_dict_saves_the_names_of_the_model_itself(tmp_path):
    torch.manual_seed(0)
    model = BertForMaskedLM(bert_config())
    own = save_final_model(model, None, tmp_path / "own")
    gathered = save_final_model(model, None, tmp_path / "gathered", _gathered(model))
    written = load_file(str(gathered / "model.safetensors"))
    assert set(written) == set(load_file(str(own / "model.safetensors")))
    assert "cls.predictions.decoder.weight" not in written  # tied to bert.embeddings.word_embeddings.weight
    reloaded = BertForMaskedLM.from_pretrained(gathered)
    assert reloaded.cls.predictions.decoder.weight is reloaded.bert.embeddings.word_embeddings.weight
    torch.testing.assert_close(reloaded.cls.predictions.decoder.weight, model.cls.predictions.decoder.weight)


def test_without_sharing_the_tied_names_the_gathered_save_differs(tmp_path):
    """The twin: the copies as gathered, untied, are written under the decoder's names as well."""
    torch.manual_seed(0)
    model = BertForMaskedLM(bert_config())
    copies = _gathered(model)
    assert share_tied_tensors(model, copies)["cls.predictions.decoder.weight"] is copies[
        "bert.embeddings.word_embeddings.weight"]
    model.save_pretrained(tmp_path / "untied", state_dict=copies, safe_serialization=True)
    assert "cls.predictions.decoder.weight" in load_file(str(tmp_path / "untied" / "model.safetensors"))
