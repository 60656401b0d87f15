"""The names of other libraries that ple's vLLM plugin changes: after vLLM
alone has built two engines (what the first changes once and what every
engine changes again, left out), an engine built with ``PLE_OFFLOAD=auto``
and lookahead on, a prompt prefilled in chunks with prefetch hits.  Two
names stay changed: vLLM's workers' ``execute_model`` (lookahead's step
hook; vLLM 0.32 has no public one) and torch's zip file writer (ple's one
torch patch, there since ple was imported).  The build-time swap of a class
in vLLM's model file (``tables.built_with``) is undone once the model is
built, so it is not among them; the allocation tests show it at work.
Needs vLLM (``make test-vllm``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")
pytest.importorskip("transformers")

from test_vllm import TIMEOUT_S, gemma  # noqa: E402, F401

SCRIPT = textwrap.dedent("""
    import os, sys
    from vllm import LLM, SamplingParams
    from patched_names import changed_since, snapshot

    def generate(model):
        llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", seed=0,
                  max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
                  gpu_memory_utilization=0.1, enforce_eager=True)
        prompt = {"prompt_token_ids": [(7 * i + 3) % 1000 for i in range(60)]}
        llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, detokenize=False))
        tables = llm.apply_model(lambda model: [m.table.stats()["prefetch_hits"]
                                                for m in model.modules() if hasattr(m, "table")])
        del llm
        return tables[0]

    # vLLM alone twice, each on a copy (vLLM keeps each model's class by its
    # config): what the first engine changes once, then what every engine
    # changes again.
    assert generate(sys.argv[2]) == []
    before = snapshot()
    assert generate(sys.argv[3]) == []
    every_engine = set(changed_since(before))
    before = snapshot()
    os.environ.update(PLE_OFFLOAD="auto", PLE_LOOKAHEAD_MIB="1")
    import ple.integrations.vllm
    ple.integrations.vllm.register()  # as vLLM calls it in a process started now
    (hits,) = generate(sys.argv[1])
    assert hits > 0, hits
    # One line among vLLM's log lines.
    print("CHANGED", *sorted(set(changed_since(before)) - every_engine))
""")


def test_the_plugin_changes_one_name_of_vllm_one_of_torch_and_no_other(gemma, tmp_path):
    copies = [str(shutil.copytree(gemma, tmp_path / f"copy{i}")) for i in (1, 2)]
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                   "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    for name in [name for name in environment if name.startswith("PLE_")]:
        del environment[name]
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(gemma), *copies], capture_output=True,
                         text=True, timeout=TIMEOUT_S, env=environment, cwd=Path(__file__).parent)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    (changed,) = [line.split()[1:] for line in run.stdout.splitlines()
                  if line.startswith("CHANGED")]
    assert changed == ["torch.serialization._open_zipfile_writer",
                       "vllm.v1.worker.gpu_worker.Worker.execute_model"]
