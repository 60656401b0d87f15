"""The CUDA kernel of disk_gather: equal to the CPU operator, inside
torch.compile and CUDA graphs, with prefetch, on two streams, without growth.
Skipped without a GPU."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ple
from helpers import write_fp8_table, write_gguf
from ple.formats import VALUE_FORMATS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHARD_ROWS = (97, 97, 77)
NUM_ROWS = sum(SHARD_ROWS)
DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)


def random_rows(fmt, rows: int, cols: int, rng) -> torch.Tensor:
    raw = torch.from_numpy(rng.integers(0, 256, (rows, cols * fmt.itemsize), dtype=np.uint8))
    return raw.view(fmt.storage)


# The safetensors formats; GGUF tables' CUDA tests are in test_gguf_table.py.
@pytest.fixture(scope="module", params=list(VALUE_FORMATS))
def table(request, tmp_path_factory):
    fmt = VALUE_FORMATS[request.param]
    rng = np.random.default_rng(len(request.param))
    tensors = {f"emb.shard_{i}.weight": random_rows(fmt, rows, 17, rng)
               for i, rows in enumerate(SHARD_ROWS)}
    if fmt.scaled:
        tensors["emb.weight_scale"] = torch.tensor(0.37)
    path = tmp_path_factory.mktemp(request.param) / "t.safetensors"
    save_file(tensors, str(path))
    with ple.Table.from_safetensors(path) as opened:
        yield opened


@pytest.fixture
def fp8_table(tmp_path):
    with ple.Table.from_safetensors(write_fp8_table(tmp_path / "fp8.safetensors")) as opened:
        yield opened


def random_ids(num_rows: int, shape, seed: int, dtype=torch.int64) -> torch.Tensor:
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, num_rows, shape))
    return ids.to(dtype)


def assert_same(gpu: torch.Tensor, cpu: torch.Tensor) -> None:
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("id_dtype", (torch.int64, torch.int32), ids=str)
def test_equal_to_the_cpu_operator(table, dtype, id_dtype):
    ids = random_ids(NUM_ROWS, (6, 50), seed=3, dtype=id_dtype)
    ids[0, :3] = torch.tensor([0, NUM_ROWS - 1, 97])
    gpu = torch.ops.ple.disk_gather(ids.cuda(), table.handle, dtype)
    assert_same(gpu, torch.ops.ple.disk_gather(ids, table.handle, dtype))


# (device_rows, host_rows, first_row): every source; every row resident.
TIER_SPLITS = [(100, 80, 30), (NUM_ROWS, 0, 0), (150, NUM_ROWS - 150, 0)]


@pytest.mark.parametrize("device_rows, host_rows, first_row", TIER_SPLITS)
@pytest.mark.parametrize("dtype", (None, torch.bfloat16), ids=str)
def test_equal_to_the_cpu_operator_with_tiers(table, dtype, device_rows, host_rows, first_row):
    """The decoder of every row format reading each row from its tier."""
    ids = random_ids(NUM_ROWS, (6, 50), seed=4)
    expected = torch.ops.ple.disk_gather(ids, table.handle, dtype)
    table.place(device_rows=device_rows, host_rows=host_rows, device="cuda", first_row=first_row)
    try:
        assert_same(torch.ops.ple.disk_gather(ids.cuda(), table.handle, dtype), expected)
        strided = ids.reshape(-1).cuda()[::3]  # 1-D, not contiguous
        assert_same(torch.ops.ple.disk_gather(strided, table.handle, dtype), expected.reshape(300, -1)[::3])
    finally:
        table.place()


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])  # the block formats gguf quantizes
@pytest.mark.parametrize("device_rows, host_rows, first_row", [(0, 0, 0), *TIER_SPLITS])
def test_gguf_blocks_with_tiers_equal_the_cpu_operator(tmp_path, name, device_rows, host_rows, first_row):
    """The block decoder reading each row from its tier (and without tiers)."""
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[name]
    weights = np.random.default_rng(9).standard_normal((NUM_ROWS, 512)).astype(np.float32)
    path = tmp_path / "t.gguf"
    write_gguf(path, {name: (gguf.quants.quantize(weights, qtype), qtype)})
    ids = random_ids(NUM_ROWS, (40,), seed=5)
    with ple.Table.from_gguf(path, name) as table:
        expected = torch.ops.ple.disk_gather(ids, table.handle, torch.float16)
        table.place(device_rows=device_rows, host_rows=host_rows, device="cuda", first_row=first_row)
        assert_same(torch.ops.ple.disk_gather(ids.cuda(), table.handle, torch.float16), expected)


def test_launches_like_earlier_ones_with_other_alignments_tiers_and_dtypes(fp8_table):
    """A launch that specializes as an earlier one reuses its compiled kernel
    (kernels/launch_cache.py): calls in turn with the ids at other alignments
    (views 8 bytes apart, read in place with every row resident), other
    tiers and other dtypes each give the CPU operator's rows."""
    rows = fp8_table.num_rows
    ids = random_ids(rows, (65,), seed=6)
    on_gpu = ids.cuda()
    try:
        for device_rows, host_rows in ((rows, 0), (rows // 3, rows // 3), (0, 0)):
            fp8_table.place(device_rows=device_rows, host_rows=host_rows, device="cuda")
            for view in (slice(1, None), slice(None, -1), slice(1, None), slice(2, None)):
                for dtype in (torch.bfloat16, torch.float32, torch.bfloat16):
                    assert_same(torch.ops.ple.disk_gather(on_gpu[view], fp8_table.handle, dtype),
                                torch.ops.ple.disk_gather(ids[view], fp8_table.handle, dtype))
    finally:
        fp8_table.place()
    # Where torch has a static launcher, the decoder's launches went through it.
    if hasattr(torch._C, "_StaticCudaLauncher"):
        from ple.kernels.decode_triton import _launches, decode_rows_kernel
        from ple.kernels.launch_cache import StaticLaunch

        launchers = _launches(decode_rows_kernel).launchers()
        assert launchers and {type(launcher) for launcher in launchers} == {StaticLaunch}


def test_large_request_through_the_device_copy(fp8_table):
    ids = random_ids(5000, (40000,), seed=4)  # 6.4 MB staged: above the UVA threshold
    gpu = torch.ops.ple.disk_gather(ids.cuda(), fp8_table.handle, torch.bfloat16)
    assert_same(gpu, torch.ops.ple.disk_gather(ids, fp8_table.handle, torch.bfloat16))


def test_non_contiguous_and_empty_ids(fp8_table):
    ids = random_ids(5000, (30, 8), seed=5).cuda().t()
    assert_same(torch.ops.ple.disk_gather(ids, fp8_table.handle),
                torch.ops.ple.disk_gather(ids.cpu(), fp8_table.handle))
    empty = torch.ops.ple.disk_gather(torch.empty(0, 4, dtype=torch.int64, device="cuda"),
                                      fp8_table.handle)
    assert empty.shape == (0, 4, 160) and empty.is_cuda


def test_opcheck(fp8_table):
    for ids in (random_ids(5000, (16,), 6).cuda(), random_ids(5000, (4, 9), 7, torch.int32).cuda()):
        torch.library.opcheck(torch.ops.ple.disk_gather.default, (ids, fp8_table.handle, torch.bfloat16))
        torch.library.opcheck(torch.ops.ple.disk_gather.default, (ids, fp8_table.handle, None))


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_without_breaks_or_skipped_cudagraphs(fp8_table, mode):
    from torch._dynamo.utils import counters

    handle = fp8_table.handle

    def embed(ids):
        return torch.ops.ple.disk_gather(ids, handle, torch.bfloat16) * 2  # exact in any order

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(embed, fullgraph=True, mode=mode)
    for seed in range(6):  # new ids every call, same shape
        ids = random_ids(5000, (64,), seed).cuda()
        expected = embed(ids)
        torch.testing.assert_close(compiled(ids), expected, rtol=0, atol=0)
    assert not counters["graph_break"]
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_manual_graph_replays_with_new_ids(fp8_table):
    static_ids = random_ids(5000, (256,), 0).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles the kernel) outside the capture
        torch.ops.ple.disk_gather(static_ids, fp8_table.handle, torch.float16)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.ple.disk_gather(static_ids, fp8_table.handle, torch.float16)
    for seed in range(1, 6):
        ids = random_ids(5000, (256,), seed)
        static_ids.copy_(ids)
        graph.replay()
        assert_same(static_out, torch.ops.ple.disk_gather(ids, fp8_table.handle, torch.float16))


def test_prefetch_hit_and_miss(fp8_table):
    ids = random_ids(5000, (3000,), 8)
    expected = torch.ops.ple.disk_gather(ids, fp8_table.handle)
    fp8_table.reset_stats()
    fp8_table.prefetch(ids)
    assert_same(torch.ops.ple.disk_gather(ids.cuda(), fp8_table.handle), expected)
    torch.cuda.synchronize()
    assert (fp8_table.stats()["prefetch_hits"], fp8_table.stats()["prefetch_misses"]) == (1, 0)
    fp8_table.prefetch(ids + 1)
    assert_same(torch.ops.ple.disk_gather(ids.cuda(), fp8_table.handle), expected)
    torch.cuda.synchronize()
    assert fp8_table.stats()["prefetch_misses"] == 1


def test_two_streams_at_once(fp8_table):
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    requests = [random_ids(5000, (2000,), 10 + i).cuda() for i in range(2)]
    outs = [[], []]
    for _ in range(20):
        for stream, ids, out in zip(streams, requests, outs):
            with torch.cuda.stream(stream):
                out.append(torch.ops.ple.disk_gather(ids, fp8_table.handle, torch.bfloat16))
    torch.cuda.synchronize()
    for ids, out in zip(requests, outs):
        expected = torch.ops.ple.disk_gather(ids.cpu(), fp8_table.handle, torch.bfloat16)
        for result in out:
            assert_same(result, expected)
    keys = {(s.device.index, s.cuda_stream) for s in streams}
    assert keys <= set(fp8_table._staging)


def test_no_growth_over_1000_calls(fp8_table):
    ids = random_ids(5000, (512,), 12).cuda()
    for _ in range(10):
        torch.ops.ple.disk_gather(ids, fp8_table.handle, torch.bfloat16)
    torch.cuda.synchronize()
    gc.collect()
    pinned, device = fp8_table.pinned_bytes(), torch.cuda.memory_allocated()
    for _ in range(1000):
        torch.ops.ple.disk_gather(ids, fp8_table.handle, torch.bfloat16)
    torch.cuda.synchronize()
    gc.collect()
    assert fp8_table.pinned_bytes() == pinned
    assert torch.cuda.memory_allocated() == device


def test_pinned_buffers_are_sized_to_the_request(fp8_table):
    torch.ops.ple.disk_gather(random_ids(5000, (1000,), 13).cuda(), fp8_table.handle)
    torch.cuda.synchronize()
    staging = fp8_table.staging_for(torch.cuda.current_stream())
    assert staging.capacity >= 1000
    assert staging.rows.nbytes == -(-staging.capacity * 160 // 4096) * 4096


def test_a_bad_id_gives_nan_and_the_next_call_raises(fp8_table):
    bad = torch.tensor([1, 5000], device="cuda")
    out = torch.ops.ple.disk_gather(bad, fp8_table.handle)
    torch.cuda.synchronize()
    assert out.isnan().all()
    with pytest.raises(RuntimeError, match=r"row id 5000 at position 1 is out of range \[0, 5000\)"):
        torch.ops.ple.disk_gather(bad[:1], fp8_table.handle)
    good = torch.ops.ple.disk_gather(bad[:1], fp8_table.handle)  # the error is raised once
    assert_same(good, torch.ops.ple.disk_gather(bad[:1].cpu(), fp8_table.handle))


def test_a_truncated_file_gives_nan_and_the_next_call_raises(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"t": torch.ones(20000, 160, dtype=torch.uint8)}, str(path))
    with ple.Table.from_safetensors(path) as table:
        table.drop_page_cache()
        os.truncate(path, os.path.getsize(path) // 2)
        lost = torch.tensor([2, 19999], device="cuda")
        out = torch.ops.ple.disk_gather(lost, table.handle)
        torch.cuda.synchronize()
        assert out.isnan().all()
        with pytest.raises(RuntimeError, match=r"row 19999 could not be read"):
            torch.ops.ple.disk_gather(lost[:1], table.handle)
        kept = torch.ops.ple.disk_gather(lost[:1], table.handle)
        assert (kept.cpu() == 1).all()


def test_a_pinned_buffer_dropped_without_free_is_unlocked():
    """Each buffer is dropped at once, so the next mapping usually takes its
    address: one left registered would make the next registration fail."""
    from ple.staging import PinnedBuffer

    for _ in range(20):
        assert PinnedBuffer(1 << 16).nbytes == 1 << 16
