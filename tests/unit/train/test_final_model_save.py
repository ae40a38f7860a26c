"""The final model is written without importing DeepSpeed when the run never used it (about 4 s per run)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# One fresh interpreter (the test process may have imported deepspeed already): a save before deepspeed is
# imported, then one after, as a run under DeepSpeed saves.
SAVES = textwrap.dedent(
    """
    import sys, tempfile
    import torch
    from accelerate.utils import imports, other
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from memfit.checkpoint_files import save_final_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=64))
    for moment in ("before", "after"):
        if moment == "after":
            import deepspeed
        directory = save_final_model(model, None, tempfile.mkdtemp() + "/final")
        loaded = AutoModelForCausalLM.from_pretrained(directory)
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
        print(moment, "| deepspeed imported:", "deepspeed" in sys.modules, "| same weights:", same,
              "| lookup restored:", other.is_deepspeed_available is imports.is_deepspeed_available)
    """
)


def test_the_final_model_is_saved_without_importing_deepspeed_unless_the_run_imported_it():
    result = subprocess.run([sys.executable, "-c", SAVES], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("before", "after"))]
    # accelerate's unwrap imports deepspeed (and mlflow through it) only to ask isinstance(DeepSpeedEngine)
    assert lines == ["before | deepspeed imported: False | same weights: True | lookup restored: True",
                     "after | deepspeed imported: True | same weights: True | lookup restored: True"]
