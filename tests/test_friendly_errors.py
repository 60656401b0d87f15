"""The common mistakes get errors that say what to do: a table where the
operators take a handle, a GGUF file opened as safetensors, one shard of a
family opened by name (it keeps the family's scale), a path that is not
UTF-8, a tensor name where the operators take a handle, ids that are sparse
or nested, a gather once Python is finalizing, and the same at every entry
of the three layers (forward, row_ids, prefetch, lookahead), which take
lists and arrays as ple.gather does; ple.FORMATS lists every format and
ple.__version__ is the package's."""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ple
from helpers import write_arange_table, write_gguf


@pytest.fixture
def table(tmp_path):
    values = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    save_file({"w": values}, str(tmp_path / "w.safetensors"))
    with ple.Table.from_safetensors(tmp_path) as opened:
        yield opened, values


def test_gather_takes_the_table(table):
    opened, values = table
    assert torch.equal(ple.gather(opened, [4, 1]), values[[4, 1]])
    assert torch.equal(ple.gather(opened, torch.tensor([[0], [5]]), torch.bfloat16),
                       values[torch.tensor([[0], [5]])].to(torch.bfloat16))


def test_gather_names_what_is_not_a_table(table):
    opened, _ = table
    with pytest.raises(TypeError, match=r"^ple.gather takes a ple.Table, not str \(the operators "
                                        r"take table.handle\)$"):
        ple.gather(opened.handle, [1])


def test_the_operators_given_a_tensor_name_say_to_pass_the_handle(table):
    opened, values = table
    expected = (f"ple: 'w' is a tensor name, not a table handle: pass the table's handle, "
                f"table.handle ({opened.handle!r}), or call ple.gather(table, ids)")
    for call in (lambda: torch.ops.ple.disk_gather(torch.tensor([1]), "w"),
                 lambda: torch.ops.ple.disk_gather_bytes(torch.tensor([1]), "w")):
        with pytest.raises(ValueError) as raised:
            call()
        assert str(raised.value) == expected
    with pytest.raises(ValueError) as raised:
        torch.ops.ple.disk_gather(torch.tensor([1]), "v")
    assert str(raised.value) == ("ple: 'v' is not a table handle (\"<name>@<digest>\"): pass an "
                                 "open table's table.handle, or call ple.gather(table, ids)")
    assert torch.equal(torch.ops.ple.disk_gather(torch.tensor([1]), opened.handle), values[[1]])


DENSE = "takes ids as a dense (strided) int32 or int64 tensor of any shape, not "
NESTED = "a nested tensor: gather ids.values() (layout=torch.jagged) or each of ids.unbind()"


def nested(layout):
    return torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3])], layout=layout)


@pytest.mark.parametrize("make, what", [
    (lambda: torch.tensor([[0, 1], [2, 0]]).to_sparse(),
     "a torch.sparse_coo tensor: pass ids.to_dense()"),
    (lambda: torch.tensor([[0, 1], [2, 0]]).to_sparse_csr(),
     "a torch.sparse_csr tensor: pass ids.to_dense()"),
    (lambda: nested(torch.strided), NESTED),
    (lambda: nested(torch.jagged), NESTED),
], ids=["sparse_coo", "sparse_csr", "nested", "jagged"])
@pytest.mark.filterwarnings("ignore")  # torch's warnings that sparse and nested are in beta
def test_sparse_and_nested_ids_say_what_ple_takes(table, make, what):
    """Not torch's "NestedTensorImpl doesn't support sizes" or "Could not run
    'ple::disk_gather' with arguments from the 'SparseCPU' backend": every
    way to a gather names the dense ids it takes, with or without autograd."""
    opened, _ = table
    ids = make()
    calls = {
        "ple.disk_gather": lambda: torch.ops.ple.disk_gather(ids, opened.handle),
        "ple.disk_gather_bytes": lambda: torch.ops.ple.disk_gather_bytes(ids, opened.handle),
        "ple.gather": lambda: ple.gather(opened, ids),
        "ple: gather_bytes": lambda: opened.gather_bytes(ids),
        "ple: prefetch": lambda: opened.prefetch(ids),
        "ple's embedding layers": lambda: ple.layers.DiskEmbedding(opened)(ids),
    }
    for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        for caller, call in calls.items():
            operator = caller.startswith("ple.disk_gather")
            if operator and mode is torch.inference_mode and ids.is_nested:
                continue  # a nested tensor goes there to its own dispatch, which knows no ple op
            with mode(), pytest.raises(TypeError) as raised:
                call()
            assert str(raised.value) == f"{caller} {DENSE}{what}", (mode, caller)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.filterwarnings("ignore")  # torch's warnings that sparse and nested are in beta
def test_sparse_and_nested_cuda_ids_say_what_ple_takes(table):
    opened, _ = table
    dense = torch.tensor([[0, 1], [2, 0]], device="cuda")
    for ids, what in ((dense.to_sparse(), "a torch.sparse_coo tensor: pass ids.to_dense()"),
                      (dense.to_sparse_csr(), "a torch.sparse_csr tensor: pass ids.to_dense()"),
                      (nested(torch.jagged).cuda(), NESTED)):
        for caller, call in (("ple.disk_gather", torch.ops.ple.disk_gather),
                             ("ple.gather", lambda ids, handle: ple.gather(opened, ids))):
            with pytest.raises(TypeError) as raised:
                call(ids, opened.handle)
            assert str(raised.value) == f"{caller} {DENSE}{what}"


def test_a_gather_while_python_finalizes_says_the_process_is_exiting(table, tmp_path):
    """An object that gathers in its __del__ when the interpreter collects
    it at exit: the gather is refused with a message saying why, not with
    torch's errors of an operator library being undone."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys, torch, ple
        t = ple.Table.from_safetensors({str(tmp_path)!r})
        ids = torch.tensor([1, 2])

        class GathersWhenCollected:
            def __del__(self):
                for call in (lambda: ple.gather(t, ids),
                             lambda: torch.ops.ple.disk_gather(ids, t.handle)):
                    try:
                        call()
                        print("gathered", flush=True)
                    except RuntimeError as error:
                        print(error, flush=True)

        late = GathersWhenCollected()
        late.cycle = late  # collected by the interpreter's last collections
        del late
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    exiting = ("ple: the process is exiting (Python is finalizing its modules): no gather runs "
               "now; gather before the interpreter exits (an atexit handler still may)")
    assert (result.returncode, result.stdout, result.stderr) == (0, f"{exiting}\n" * 2, "")


# The layers' entries: each checks its ids as ple.gather does.
HASHING = dict(vocab_size=300, eos_id=2, base_size=30, ple_layer_index=0)
LAYER_ROWS = 60


def open_layers(directory: Path) -> dict:
    """The three layers over small tables of their own in ``directory``."""
    from ple.layers import DiskEmbedding, NGramEmbedding, NGramHashing, PackedGGUFEmbedding

    values = torch.arange(LAYER_ROWS * 4, dtype=torch.float32).reshape(LAYER_ROWS, 4)
    ngram_rows = NGramHashing(**HASHING).rows
    save_file({"w": values, "ngram_embedding": torch.ones(ngram_rows, 4)},
              str(directory / "layers.safetensors"))
    write_gguf(directory / "layers.gguf",
               {"token_embd.weight": (np.ones((LAYER_ROWS, 32), dtype=np.float32),
                                      gguf.GGMLQuantizationType.F32)})
    return {"DiskEmbedding": DiskEmbedding.from_safetensors(directory / "layers.safetensors", "w"),
            "NGramEmbedding": NGramEmbedding.from_safetensors(
                directory / "layers.safetensors", "ngram_embedding", dtype=torch.float32,
                **HASHING),
            "PackedGGUFEmbedding": PackedGGUFEmbedding(directory / "layers.gguf",
                                                       dtype=torch.float32)}


@pytest.fixture
def layers(tmp_path):
    opened = open_layers(tmp_path)
    yield opened
    for layer in opened.values():
        layer.table.close()


def layer_entries(layer, ids) -> dict:
    """Each entry of ``layer`` called with ``ids``, by the caller its errors name."""
    return {"forward": ("ple's embedding layers", lambda: layer(ids)),
            "row_ids": ("ple's embedding layers", lambda: layer.row_ids(ids)),
            "prefetch": ("ple's embedding layers", lambda: layer.prefetch(ids)),
            "lookahead": ("ple: lookahead", lambda: layer.lookahead(ids, 1, dim=0))}


@pytest.mark.parametrize("make, what", [
    (lambda: torch.tensor([[0, 1], [2, 0]]).to_sparse(),
     "a torch.sparse_coo tensor: pass ids.to_dense()"),
    (lambda: torch.tensor([[0, 1], [2, 0]]).to_sparse_csr(),
     "a torch.sparse_csr tensor: pass ids.to_dense()"),
    (lambda: nested(torch.strided), NESTED),
    (lambda: nested(torch.jagged), NESTED),
], ids=["sparse_coo", "sparse_csr", "nested", "jagged"])
@pytest.mark.filterwarnings("ignore")  # torch's warnings that sparse and nested are in beta
def test_sparse_and_nested_ids_at_every_layer_entry_say_what_ple_takes(layers, make, what):
    ids = make()
    for name, layer in layers.items():
        for entry, (caller, call) in layer_entries(layer, ids).items():
            with pytest.raises(TypeError) as raised:
                call()
            assert str(raised.value) == f"{caller} {DENSE}{what}", (name, entry)
        assert not layer.looking_ahead


def test_the_layers_take_lists_and_arrays_as_ple_gather_does(layers):
    tokens = [4, 1, 7]
    for name, layer in layers.items():
        want = layer(torch.tensor(tokens))
        for given in (tokens, np.array(tokens)):
            assert torch.equal(layer(given), want), name
            assert torch.equal(layer.row_ids(given), layer.row_ids(torch.tensor(tokens))), name
        layer.table.reset_stats()
        layer.prefetch(tokens)
        layer(tokens)
        assert layer.table.stats()["prefetch_hits"] == 1, name
        plan = layer.lookahead(layer.row_ids(tokens).tolist(), 1)
        assert plan is not None and plan.looking_ahead, name
        layer.end_lookahead(plan)


def test_lookahead_takes_row_ids(layers):
    """Floats are no row ids; an n-gram layer's are [T, heads], and a
    prompt's tokens given in their place have no dimension of heads."""
    layer = layers["NGramEmbedding"]
    with pytest.raises(TypeError) as raised:
        layer.lookahead(torch.zeros(4, 2), 1)
    assert str(raised.value) == ("ple: lookahead takes row ids as an int32 or int64 tensor "
                                 "(layer.row_ids(...)), not torch.float32")
    with pytest.raises(ValueError) as raised:
        layer.lookahead(torch.tensor([4, 1, 7]), 1)
    assert str(raised.value) == ("ple: lookahead splits the row ids [3] along dim -2, which they "
                                 "do not have: pass layer.row_ids(...) of the whole prompt")
    assert not layer.looking_ahead


def test_a_layer_while_python_finalizes_says_the_process_is_exiting(tmp_path):
    """Each entry of each layer called in an object's __del__ when the
    interpreter collects it at exit: refused with ple.gather's message, not
    torch's argument parser nor an abort."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys, torch
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_friendly_errors import layer_entries, open_layers
        layers = open_layers(Path({str(tmp_path)!r}))
        ids = torch.tensor([1, 2])

        class GathersWhenCollected:
            def __del__(self):
                for layer in layers.values():
                    for _, call in layer_entries(layer, ids).values():
                        try:
                            call()
                            print("gathered", flush=True)
                        except RuntimeError as error:
                            print(error, flush=True)

        late = GathersWhenCollected()
        late.cycle = late  # collected by the interpreter's last collections
        del late
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    exiting = ("ple: the process is exiting (Python is finalizing its modules): no gather runs "
               "now; gather before the interpreter exits (an atexit handler still may)")
    assert (result.returncode, result.stdout, result.stderr) == (0, f"{exiting}\n" * 12, "")


def test_a_gguf_file_opened_as_safetensors_says_so(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path, {"t": (np.zeros((4, 32), dtype=np.float32), gguf.GGMLQuantizationType.F32)})
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: a GGUF file, not a safetensors "
                                         r"file: open it with ple.Table.from_gguf\(path, tensor\)$"):
        ple.Table.from_safetensors(path)


def test_one_shard_of_a_family_keeps_the_familys_scale(tmp_path):
    raw = torch.randint(0, 120, (2, 5, 8), dtype=torch.uint8)  # finite FP8 patterns
    save_file({f"x.shard_{i}.weight": raw[i].view(torch.float8_e4m3fn) for i in range(2)}
              | {"x.weight_scale": torch.tensor(0.5)}, str(tmp_path / "x.safetensors"))
    with ple.Table.from_safetensors(tmp_path, "x.shard_1.weight") as shard:
        assert shard.scale == 0.5
        expected = raw[1].view(torch.float8_e4m3fn).to(torch.float32) * 0.5
        assert torch.equal(ple.gather(shard, torch.arange(5)), expected)


def test_formats_lists_every_format():
    assert {"f32", "f16", "bf16", "fp8_e4m3fn", "u8", "i8", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0",
            "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq2_xxs", "iq2_xs", "iq3_xxs", "iq1_s",
            "iq4_nl", "iq3_s", "iq2_s", "iq4_xs", "iq1_m", "tq1_0", "tq2_0", "mxfp4",
            "nvfp4"} == set(ple.FORMATS)


def test_version_is_the_packages():
    assert ple.__version__ == importlib.metadata.version("ple")


def test_a_path_that_is_not_utf8_opens_and_its_errors_name_it(tmp_path):
    # Python hands such a name over as a str with surrogate escapes (os.fsdecode).
    directory = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"rows\xff")))
    directory.mkdir()
    path = write_arange_table(directory / "t\udcfe.safetensors", rows=4096, cols=16)
    with ple.Table.from_safetensors(directory) as table:
        assert table.paths == [path]
        assert torch.equal(ple.gather(table, [3]), torch.arange(48, 64, dtype=torch.float32)[None])
        os.truncate(path, 4096)
        # The native error names the file as Python would, not UnicodeDecodeError.
        with pytest.raises(OSError, match=re.escape(str(path))):
            ple.gather(table, [4095])
