"""The final model is written without importing DeepSpeed when the run never used it (about 4 s per run)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SAVE = textwrap.dedent(
    """
    import sys, tempfile
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from memfit.checkpoint_files import save_final_model
    {before}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=64))
    directory = save_final_model(model, None, tempfile.mkdtemp() + "/final")
    loaded = AutoModelForCausalLM.from_pretrained(directory)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    from accelerate.utils import other, imports
    print("deepspeed imported:", "deepspeed" in sys.modules, "| same weights:", same,
          "| lookup restored:", other.is_deepspeed_available is imports.is_deepspeed_available)
    """
)


def _save(before: str = "") -> str:
    result = subprocess.run([sys.executable, "-c", SAVE.format(before=before)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


def test_the_final_model_is_saved_without_importing_deepspeed():
    # accelerate's unwrap imports deepspeed (and mlflow through it) only to ask isinstance(DeepSpeedEngine)
    assert _save() == "deepspeed imported: False | same weights: True | lookup restored: True"


def test_a_run_that_imported_deepspeed_saves_through_the_unchanged_lookup():
    assert _save("import deepspeed") == "deepspeed imported: True | same weights: True | lookup restored: True"
