"""A DiskEmbedding's state dict holds its table as the checkpoint holds it,
over the files the table maps (nothing read until saved, no copy); its
weight_scale goes through state_dict, a move to the meta device and back,
to_empty and load_state_dict without losing its value; load_state_dict takes
a table equal to the files' and refuses other values; and saving over a file
the process maps writes beside it and renames, so the served rows stay."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from safetensors.torch import save_file

from allocations import recording
from helpers import assert_same_bits, random_fp8_bytes, write_gguf
from ple.layers import DiskEmbedding

ROWS, COLS = 300, 24


@pytest.fixture
def checkpoint(tmp_path):
    """A folder with a bf16 table, an FP8 table with its scale, and a shard
    family over two files; and those tensors."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    tensors = {
        "bf16.weight": torch.randn(ROWS, COLS).to(torch.bfloat16),
        "fp8.weight": torch.from_numpy(random_fp8_bytes(rng, (ROWS, COLS))).view(
            torch.float8_e4m3fn),
        "fp8.weight_scale": torch.tensor([0.0625], dtype=torch.float32),
        "fam.shard_0.weight": torch.randn(100, COLS),
        "fam.shard_1.weight": torch.randn(50, COLS),
    }
    save_file({k: v for k, v in tensors.items() if k != "fam.shard_1.weight"},
              str(tmp_path / "a.safetensors"))
    save_file({"fam.shard_1.weight": tensors["fam.shard_1.weight"]},
              str(tmp_path / "b.safetensors"))
    return tmp_path, tensors


def test_the_state_dict_holds_the_table_as_the_files_do(checkpoint):
    directory, tensors = checkpoint
    with DiskEmbedding.from_safetensors(directory, "bf16.weight") as embedding:
        state = embedding.state_dict()
        assert list(state) == ["weight"]
        assert_same_bits(state["weight"], tensors["bf16.weight"])
    with DiskEmbedding.from_safetensors(directory, "fam") as embedding:
        state = embedding.state_dict()
        assert list(state) == ["shard_0.weight", "shard_1.weight"]
        for i in range(2):
            assert_same_bits(state[f"shard_{i}.weight"], tensors[f"fam.shard_{i}.weight"])
    with DiskEmbedding.from_safetensors(directory, "fp8.weight") as embedding:
        state = embedding.state_dict()  # the checkpoint's scale tensor
        assert_same_bits(state["weight"], tensors["fp8.weight"])
        assert_same_bits(state["weight_scale"], tensors["fp8.weight_scale"])
    with DiskEmbedding.from_safetensors(directory, "fp8.weight", dtype=torch.bfloat16,
                                        round_scale=True) as embedding:
        state = embedding.state_dict()  # FP8Embedding's: the scale in the module's dtype
        assert state["weight_scale"].dtype == torch.bfloat16
        assert float(state["weight_scale"]) == 0.0625


def test_the_state_dict_maps_the_files_and_copies_nothing(checkpoint):
    directory, _ = checkpoint
    with DiskEmbedding.from_safetensors(directory, "bf16.weight") as embedding:
        with recording(1) as made:
            state = embedding.state_dict()
        assert [m for m in made.made if m.allocated] == []
        assert state["weight"].untyped_storage().nbytes() < ROWS * COLS * 2 + 2 * 4096


def test_load_state_dict_takes_the_tables_values_and_refuses_others(checkpoint):
    directory, tensors = checkpoint
    with DiskEmbedding.from_safetensors(directory, "bf16.weight", dtype=torch.float32) as emb:
        assert str(emb.load_state_dict(emb.state_dict())) == "<All keys matched successfully>"
        # A model loaded in float32 holds the values cast: they are the table's too.
        emb.load_state_dict({"weight": tensors["bf16.weight"].float()})
        emb.load_state_dict({})  # a state dict without the table (an older one) loads
        changed = tensors["bf16.weight"].clone()
        changed[7, 3] += 1
        with pytest.raises(RuntimeError, match=r"weight: ple serves 'bf16.weight' from its "
                                               r"files, and the state dict's values differ from "
                                               r"them \(first at row 7\)"):
            emb.load_state_dict({"weight": changed})


def test_weight_scale_survives_meta_to_empty_and_load_state_dict(checkpoint):
    """What meta-init and FSDP2 loaders do: state_dict, .to("meta"),
    .to_empty(device="cpu"), load_state_dict; the rows stay those of
    transformers' FP8Embedding arithmetic, never uninitialised memory."""
    directory, tensors = checkpoint
    ids = torch.arange(ROWS)
    with DiskEmbedding.from_safetensors(directory, "fp8.weight", dtype=torch.bfloat16,
                                        round_scale=True) as embedding:
        want = tensors["fp8.weight"].to(torch.bfloat16) * torch.tensor(0.0625, dtype=torch.bfloat16)
        assert_same_bits(embedding(ids), want)
        state = embedding.state_dict()
        embedding.to("meta")
        embedding.to_empty(device="cpu")
        assert_same_bits(embedding(ids), want)
        embedding.weight_scale.fill_(9e10)  # as if to_empty had left it so
        embedding.load_state_dict(state)
        assert_same_bits(embedding(ids), want)
        embedding.half()
        half = tensors["fp8.weight"].to(torch.float16) * torch.tensor(0.0625).to(
            torch.bfloat16).to(torch.float16)
        assert_same_bits(embedding(ids), half)


def test_a_gguf_table_keeps_nothing_in_the_state_dict(tmp_path):
    import gguf

    rng = np.random.default_rng(0)
    values = rng.standard_normal((8, 64)).astype(np.float32)
    write_gguf(tmp_path / "t.gguf", {"t": (gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                                         gguf.GGMLQuantizationType.Q8_0)})
    with DiskEmbedding.from_gguf(tmp_path / "t.gguf", "t") as embedding:
        assert embedding.state_dict() == {}


def test_a_closed_table_says_it_cannot_be_saved(checkpoint):
    directory, _ = checkpoint
    embedding = DiskEmbedding.from_safetensors(directory, "bf16.weight")
    embedding.close()
    with pytest.raises(ValueError, match="closed"):
        embedding.state_dict()


@pytest.mark.parametrize("writer", ["safetensors", "torch.save"])
def test_saving_over_a_served_file_replaces_it_and_the_rows_stay(checkpoint, writer):
    directory, tensors = checkpoint
    served = directory / "a.safetensors"
    ids = torch.arange(ROWS)
    with DiskEmbedding.from_safetensors(directory, "bf16.weight") as embedding:
        before = embedding(ids)
        inode = served.stat().st_ino
        if writer == "safetensors":
            safetensors.torch.save_file(embedding.state_dict(), served)
            assert_same_bits(safetensors.torch.load_file(served)["weight"],
                             tensors["bf16.weight"])
        else:
            torch.save(embedding.state_dict(), served)
            with open(served, "rb") as f:
                assert_same_bits(torch.load(f)["weight"], tensors["bf16.weight"])
        assert served.stat().st_ino != inode  # a new file, renamed over the old name
        assert_same_bits(embedding(ids), before)
        assert not list(directory.glob(".*.tmp"))
    other = directory / "other.pt"
    torch.save(torch.zeros(3), other)
    inode = other.stat().st_ino
    torch.save(torch.ones(3), other)  # a file no one maps is written as before
    assert other.stat().st_ino == inode


PATCHES = textwrap.dedent("""
    import sys, torch, safetensors.torch, transformers
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig
    from patched_names import changed_since, snapshot

    config = Gemma3nTextConfig(**eval(sys.argv[2]))
    torch.manual_seed(0)
    Gemma3nForCausalLM(config).save_pretrained(sys.argv[1])
    before = snapshot()
    from ple.integrations.transformers import from_pretrained
    model = from_pretrained(Gemma3nForCausalLM, sys.argv[1])
    model.generate(torch.tensor([[1, 2, 3, 4, 5]]), max_new_tokens=2, prefill_chunk_size=2)
    model.save_pretrained(sys.argv[1] + "-saved")
    torch.save(model.state_dict(), sys.argv[1] + "-state.pt")
    print("\\n".join(changed_since(before)))
""")


def test_ple_patches_two_names_of_other_libraries_and_no_other(tmp_path):
    """torch's zip file writer (a file the process maps is written beside and
    renamed), and the served model class's generate."""
    pytest.importorskip("transformers")
    from test_transformers_integration import GEMMA_CONFIG

    run = subprocess.run([sys.executable, "-c", PATCHES, str(tmp_path / "m"), repr(GEMMA_CONFIG)],
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [
        "torch.serialization._open_zipfile_writer",
        "transformers.models.gemma3n.modeling_gemma3n.Gemma3nForCausalLM.generate"]
