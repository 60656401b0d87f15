"""Code compiled against a table's handle, run after the table closed: the
error names the table and says it is closed (before, a compiled graph that
kept the handle said only "no open ple table has handle N").  README
"Reliability"."""

from __future__ import annotations

import pytest
import torch

import ple
from helpers import write_arange_table


@pytest.fixture
def table(tmp_path):
    path = write_arange_table(tmp_path / "t.safetensors", rows=10, cols=4, name="ngram_rows")
    with ple.Table.from_safetensors(path) as table:
        yield table


def test_the_handle_of_a_closed_table_names_it(table):
    handle = table.handle
    table.close()
    with pytest.raises(ValueError, match=r"ple table 'ngram_rows' is closed: a table must stay open"):
        table.handle
    with pytest.raises(ValueError, match=rf"ple table 'ngram_rows' \(handle {handle}\) is closed"):
        torch.ops.ple.disk_gather(torch.tensor([1]), handle)
    with pytest.raises(ValueError, match=rf"ple table 'ngram_rows' \(handle {handle}\) is closed"):
        torch.ops.ple.disk_gather_bytes(torch.tensor([1]), handle)


@pytest.mark.slow  # two compiles: about 8 s on 2 cores
def test_compiled_code_run_after_close_names_the_table(table):
    torch._dynamo.reset()
    handle = table.handle  # as a layer keeps it: a constant of the graph

    @torch.compile(fullgraph=True, dynamic=False)
    def kept(ids):
        return torch.ops.ple.disk_gather(ids, handle) * 2

    ids = torch.tensor([3, 1])
    assert torch.equal(kept(ids), torch.tensor([[24., 26., 28., 30.], [8., 10., 12., 14.]]))
    table.close()
    # The compiled graph runs the operator's CPU kernel, which raises.
    with pytest.raises(ValueError, match=rf"ple table 'ngram_rows' \(handle {handle}\) is closed: "
                                         "a table must stay open while code that gathers from it "
                                         "runs, compiled code"):
        kept(ids)

    # Reading table.handle inside the compiled function: dynamo traces the
    # property's raise and reports it as its own error (Unsupported in torch
    # 2.13, "Observed exception") quoting ple's message.
    @torch.compile(fullgraph=True, dynamic=False)
    def reads(ids):
        return torch.ops.ple.disk_gather(ids, table.handle)

    with pytest.raises(Exception, match=r"(?s)ple table 'ngram_rows' is closed: a table must stay open"):
        reads(ids)
    torch._dynamo.reset()
