"""memfit's Ulysses attention (all-to-all over gloo) against DeepSpeed's UlyssesSPAttentionHF and whole-row SDPA.

Two ranks, 4 query and 2 key-value heads (and 1, fewer than the ranks), 16 positions: each rank's output shard and its queries'
gradient (under a loss weighted per position, so a misplaced shard changes it) must equal the
whole-row attention's. Reversing the shard order by hand made memfit's output differ by 2.6 (in forward's
exchange) and its query gradient by 3.1 (in backward's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_helpers import EXTENSIONS_CACHE, REPO, deepspeed_available

WORKER = Path(__file__).with_name("ulysses_parity_worker.py")


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ulysses") / "parity.json"
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(EXTENSIONS_CACHE)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(WORKER), str(out)], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=environment)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not deepspeed_available(), reason="the worker starts the ranks through DeepSpeed")]


@pytest.mark.parametrize("case", ["memfit", "memfit-one-kv-head"])
def test_memfit_ulysses_equals_whole_row_attention(case, parity):
    assert parity[case]["output"] <= 1e-6 and parity[case]["query_grad"] <= 1e-6, parity


def test_deepspeed_ulysses_equals_whole_row_attention_on_gloo(parity):
    if "deepspeed_error" in parity:
        pytest.skip(f"DeepSpeed's UlyssesSPAttentionHF did not run on CPU gloo: {parity['deepspeed_error']}")
    assert parity["deepspeed"]["output"] <= 1e-6 and parity["deepspeed"]["query_grad"] <= 1e-6, parity
