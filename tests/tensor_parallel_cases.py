"""The cases of the tensor-parallel tests: their tables, inputs and layers,
the program of one rank, and the check of what the ranks saved against one
process.  The program runs as a script, once per rank (``run_ranks``):

    python tensor_parallel_cases.py DIRECTORY OUT INIT_METHOD BACKEND PLACEMENT RANK WORLD_SIZE

PLACEMENT says where a rank runs: ``cpu``; ``own-gpu``, GPU ``RANK`` (one
process per GPU, as NCCL requires); ``shared-gpu``, every rank on GPU 0 (over
gloo: NCCL refuses two ranks on one GPU).  The rank saves to
``OUT/rank{RANK}.pt`` what the tests compare with one process: the layers'
embeddings of each step of ``OUT/inputs.pt`` eager, with the n-gram rows
prefetched, compiled, replayed in a captured CUDA graph (NCCL only), and with
its own rows in its tiers, with the tables' counters; :func:`check_ranks`
compares them.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from helpers import assert_same_bits, random_fp8_bytes, run_ranks, write_gguf
from ple.layers import DiskEmbedding, NGramEmbedding, NGramHashing, PackedGGUFEmbedding
from ple.layers.parallel import row_range

HASHING = dict(vocab_size=1001, eos_id=7, ple_layer_index=2, base_size=100)
VOCAB_ROWS, COLS = 1001, 32  # 1001 = 7 * 11 * 13: no small world size divides it
SCRIPT = Path(__file__)


def write_tables(directory: Path) -> Path:
    """An n-gram checkpoint (FP8 without NaN, some -0.0 bytes) and a GGUF file
    with a Q8_0 token embedding and a table of one row."""
    rng = np.random.default_rng(0)
    raw = random_fp8_bytes(rng, (NGramHashing(**HASHING).rows + 13, COLS))
    raw[:, 0] = 0x80
    save_file({"ngram_embedding.shard_0.weight": torch.from_numpy(raw).view(torch.float8_e4m3fn),
               "ngram_embedding.weight_scale": torch.tensor(0.25)},
              str(directory / "ngram.safetensors"))
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    write_gguf(directory / "model.gguf", {
        name: (gguf.quants.quantize(rng.uniform(-1, 1, (rows, COLS)).astype(np.float32), q8_0), q8_0)
        for name, rows in (("token_embd.weight", VOCAB_ROWS), ("one_row", 1))})
    return directory


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's ``(tokens, seq_ids, context)``: 50 tokens of 3 requests.
    Every step has the same shapes, so that one captured graph replays them all."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB_ROWS, (50,), generator=generator)
    tokens[:3] = torch.tensor([0, VOCAB_ROWS - 1, HASHING["eos_id"]])
    seq_ids = torch.arange(50) // 20
    context = torch.randint(0, VOCAB_ROWS, (3, 2), generator=generator)
    return tokens, seq_ids, context


def open_layers(directory: Path, process_group=None):
    """The n-gram layer, the GGUF token embedding, the GGUF table of one row
    (a second rank has none of it), and a DiskEmbedding (the module of the
    transformers integration) over the n-gram table's FP8 rows."""
    return (NGramEmbedding.from_safetensors(directory, process_group=process_group, **HASHING),
            PackedGGUFEmbedding(directory / "model.gguf", process_group=process_group),
            PackedGGUFEmbedding(directory / "model.gguf", "one_row", process_group=process_group),
            DiskEmbedding.from_safetensors(directory / "ngram.safetensors", "ngram_embedding",
                                           dtype=torch.bfloat16, process_group=process_group))


def row_ids(layers, inputs) -> list[torch.Tensor]:
    """The table rows each layer gathers for ``inputs``, in the order of :func:`embeddings`."""
    tokens = inputs[0]
    return [layers[0].row_ids(*inputs), tokens, torch.zeros_like(tokens), tokens]


def embeddings(layers, inputs) -> list[torch.Tensor]:
    ngram, token, one_row, disk = layers
    tokens = inputs[0]
    return [ngram(*inputs), token(tokens), one_row(torch.zeros_like(tokens)), disk(tokens)]


def tier_split(served_rows: tuple[int, int], device: torch.device) -> tuple[int, int]:
    """``(device_rows, host_rows)`` a rank places: a third of its rows in each
    tier it has (no device tier on the CPU), the rest left on disk."""
    start, stop = served_rows
    third = (stop - start) // 3
    return (third, third) if device.type == "cuda" else (0, third)


def replayed(layers, steps) -> list[list[torch.Tensor]]:
    """The embeddings of each step from one CUDA graph, captured with the
    gathers and their all-reduces and replayed with each step's ids."""
    static = [t.clone() for t in steps[0]]
    # Warmed up on a side stream, as torch asks of code that is then
    # captured: the Triton kernels, ple's staging and NCCL's communicator
    # all exist before the capture starts.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        embeddings(layers, static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's watchdog thread queries its events while this
    # thread captures, which the default ("global") mode would turn into a
    # failed capture.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = embeddings(layers, static)
    replays = []
    for step in steps:
        for into, values in zip(static, step):
            into.copy_(values)
        graph.replay()
        replays.append([rows.clone() for rows in outputs])
    torch.cuda.synchronize()
    return replays


def on_cpu(value):
    """``value`` with every tensor in its lists, tuples and dicts moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(item) for item in value)
    return value


def rank_device(placement: str, rank: int) -> torch.device:
    """Where rank ``rank`` runs (see the PLACEMENT of the module's docstring)."""
    return {"cpu": torch.device("cpu"), "own-gpu": torch.device("cuda", rank),
            "shared-gpu": torch.device("cuda", 0)}[placement]


def run_rank(directory: Path, out: Path, init_method: str, backend: str, placement: str,
             rank: int, world_size: int) -> None:
    device = rank_device(placement, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            **({"device_id": device} if backend == "nccl" else {}))
    try:
        layers = open_layers(directory, dist.group.WORLD)
        host_steps = torch.load(out / "inputs.pt")
        steps = [tuple(t.to(device) for t in step) for step in host_steps]
        saved = {"served_rows": [layer.served_rows for layer in layers],
                 "eager": [embeddings(layers, step) for step in steps]}

        ngram = layers[0]
        ngram.table.reset_stats()
        ngram.prefetch(*host_steps[1])
        saved["prefetched"] = embeddings(layers, steps[1])
        saved["prefetch_hits"] = ngram.table.stats()["prefetch_hits"]

        compiled = torch.compile(functools.partial(embeddings, layers), fullgraph=True)
        saved["compiled"] = [compiled(step) for step in steps]
        # A CUDA graph captures NCCL's collectives; gloo's run on the host,
        # outside the stream, and cannot be captured.
        if backend == "nccl":
            saved["graph"] = replayed(layers, steps)

        saved["tiers"] = [tier_split(layer.served_rows, device) for layer in layers]
        for layer, (device_rows, host_rows) in zip(layers, saved["tiers"]):
            layer.place(device_rows, host_rows, device if device_rows else None)
            layer.table.reset_stats()  # place() itself read the tiers' rows
        saved["tiered"] = embeddings(layers, steps[1])
        saved["tiered_stats"] = [layer.table.stats() for layer in layers]
        saved["device_tiers_on"] = [str(layer.table.tiers.device) for layer in layers
                                    if layer.table.tiers is not None and layer.table.tiers.device_rows]
        torch.save(on_cpu(saved), out / f"rank{rank}.pt")
        for layer in layers:
            layer.table.close()
    finally:
        dist.destroy_process_group()


def run_two_ranks(tables: Path, out: Path, backend: str, placement: str, timeout_s: float,
                  env: dict[str, str] | None = None) -> None:
    """Two ranks of :func:`run_rank` over a file store in ``out``, on two
    steps' inputs; their logs go to ``out/logs``."""
    torch.save([batch(2), batch(3)], out / "inputs.pt")
    run_ranks(SCRIPT, [str(tables), str(out), f"file://{out / 'store'}", backend, placement], 2,
              timeout_s, out / "logs", env)


def assert_same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal values, with +0.0 and -0.0 taken as equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.cpu(), want.cpu())


def check_ranks(tables: Path, out: Path, world_size: int, placement: str, graph: bool,
                same=assert_same_bits) -> None:
    """Every rank's embeddings, bit for bit (``same``) those of one process
    on one device (the CPU, or GPU 0), every way it ran them (``graph``: a
    captured graph's replays too); its device tiers on its own device, and
    its tiers' counters: each id, once clamped into the rank's rows, from the
    tier that holds it, else from disk."""
    device = rank_device(placement, 0)
    layers = open_layers(tables)
    steps = torch.load(out / "inputs.pt")
    expected = [embeddings(layers, tuple(t.to(device) for t in step)) for step in steps]
    tiered_ids = row_ids(layers, steps[1])
    for rank in range(world_size):
        got = torch.load(out / f"rank{rank}.pt")
        ranges = [row_range(layer.table.num_rows, rank, world_size) for layer in layers]
        ngram_rows = layers[0].hashing.rows  # the n-gram layer reads rows [0, ngram_rows)
        assert got["served_rows"] == [tuple(min(r, ngram_rows) for r in ranges[0]), *ranges[1:]]
        assert ("graph" in got) == graph
        for way in ("eager", "compiled", "graph") if graph else ("eager", "compiled"):
            for got_step, expected_step in zip(got[way], expected, strict=True):
                for got_rows, expected_rows in zip(got_step, expected_step, strict=True):
                    same(got_rows, expected_rows)
        for got_rows, expected_rows in zip(got["prefetched"], expected[1]):
            same(got_rows, expected_rows)
        assert got["prefetch_hits"] == 1
        for got_rows, expected_rows in zip(got["tiered"], expected[1]):
            same(got_rows, expected_rows)
        for layer, ids, (start, stop), served, (device_rows, host_rows), stats in zip(
                layers, tiered_ids, ranges, got["served_rows"], got["tiers"], got["tiered_stats"]):
            # A rank gathers every id clamped into its rows; one with no rows
            # gathers the table's last row.
            first = min(start, layer.table.num_rows - 1)
            tier_row = ids.clamp(first, max(first, stop - 1)) - served[0]
            on_device = (tier_row >= 0) & (tier_row < device_rows)
            on_host = (tier_row >= device_rows) & (tier_row < device_rows + host_rows)
            assert stats["device_tier_hits"] == int(on_device.sum())
            assert stats["host_tier_hits"] == int(on_host.sum())
            assert stats["rows"] == ids.numel() - int((on_device | on_host).sum())
        placed = sum(1 for device_rows, _ in got["tiers"] if device_rows)
        assert got["device_tiers_on"] == [str(rank_device(placement, rank))] * placed
    for layer in layers:
        layer.table.close()


if __name__ == "__main__":
    run_rank(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5],
             int(sys.argv[6]), int(sys.argv[7]))
