"""Gemma 4 E4B's per-layer table on one GPU, served four ways side by side:
GPU and host memory, time to the first token and decode speed of an
E4B-shaped model (random weights, bfloat16) with the table on the GPU, on the
CPU, read by ple from the checkpoint's file, and from a quantized copy.

    ple-bench-gemma4 [--dir data/bench_gemma4] [--arms transformers,cpu-table,ple,ple-q5_k]
                     [--prompt-tokens 8500] [--new-tokens 64] [--prefill-chunk 0] [--rounds 1]
                     [--json PATH] [--tiny --device cpu]

The checkpoint is laid out as google/gemma-4-E4B-it's
(``Gemma4ForConditionalGeneration``: the text model under
``model.language_model.*``, the per-layer table
``model.language_model.embed_tokens_per_layer.weight``, 262,144 x 10,752
bf16, 5.6 GB; the vision and audio towers; about 16 GB in all), written once
tensor by tensor into safetensors shards (the names and shapes of the model
built on the meta device; vectors as the model's own init makes them, every
matrix a random block tiled over it, so that no tensor is ever in memory) and
reused while its ``ple_bench.json`` says this tool wrote it for the same
config and seed; a directory holding files the tool did not write is
refused.  The copies that ``ple-TYPE`` arms read are written beside it once,
by ``ple-quantize-table``.

Arms, by turns, each in a process of its own started after the checkpoint's
pages were dropped from the page cache (``--rounds`` repeats the turn):

- ``transformers``: ``AutoModelForCausalLM.from_pretrained(device_map=DEVICE)``,
  the whole model on the GPU, the table included;
- ``cpu-table``: the workaround of transformers issue 47705: the same load,
  then the table module moved to the CPU by hand, the ids sent to it and its
  rows brought back to the GPU by forward hooks (the load itself still holds
  the table on the GPU, as in the issue);
- ``ple``: ``ple.integrations.transformers.from_pretrained``: the table stays
  in the checkpoint's file (served through the page cache), the rest on the
  GPU; ``ple-cache:MIB`` adds a row cache of MIB MiB
  (``GatherConfig(row_cache_mib=MIB)``);
- ``ple-TYPE`` (``ple-q5_k``, any type of ``ple-quantize-table``): the table
  served from a GGUF copy of that type (``table_file=``).

Each arm loads, runs a short warm-up ``generate`` (kernels compiled, libraries
initialized), drops the checkpoint's pages again, then runs one greedy
``generate`` of ``--prompt-tokens`` random ids (uniform over the vocabulary
below its placeholders: nearly every token a row of its own, more rows than
text reads; ``--prefill-chunk`` N passes ``prefill_chunk_size=N``; 0, the
default, prefills as transformers does by default, in one forward) and
``--new-tokens`` more. Measured per phase (load; prefill, to the first token;
decode): torch's GPU memory (peak and at the phase's end:
``max_memory_allocated``, ``memory_allocated``), the GPU's used memory at the
phase's end (``mem_get_info``: the process's CUDA context, allocator pools and
everything else, with no other process on the GPU), the process's VmRSS and
VmHWM (reset at each phase), the bytes it had read from the disk
(``/proc/self/io``) and, for ple's arms, the table's counters. TTFT is the
time to the first token of the cold prompt, decode speed the median step.
Every arm must generate the same tokens (their SHA-256 is printed; the exit
status is 1 otherwise), but a quantized copy's arm (not bf16 or f32) is
compared only with its own runs. Then the goals: ple's GPU memory at most the
cpu-table arm's, its RSS at most the cpu-table arm's less the table, its TTFT
and decode speed within 1.05x of transformers alone.

``--tiny`` writes a tiny model of the same structure instead (for CI; with
``--device cpu`` it runs on the CPU in seconds, without the GPU columns).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ple_tools import written
from ple_tools.argtypes import (OutputDirectory, non_negative_int, positive_float, positive_int,
                                seed)
from ple_tools.figures import add_json_option, run_recorded

if TYPE_CHECKING:  # for annotations; torch is imported after parsing (--help imports none)
    import torch

TOOL = "ple-bench-gemma4"
INFO = "ple_bench.json"  # the checkpoint's marker (ple_tools.written)
WHAT = "a checkpoint"
INDEX_FILE = "model.safetensors.index.json"
TABLE = "model.language_model.embed_tokens_per_layer.weight"  # the published checkpoints' name
TABLE_MODULE = TABLE.removesuffix(".weight")
# google/gemma-4-E4B-it's text model as its config.json gives it; no download
# here, the sizes are those public code and notes agree on:
# NVIDIA-NeMo/Megatron-Bridge's test of its Gemma 4 E4B recipe (an HF config
# "mirroring google/gemma-4-E4B-it": 42 layers, hidden 2560, intermediate
# 10240, 8 heads, 2 KV heads, head_dim 256 and 512 on full-attention layers,
# 18 KV-shared layers, per-layer inputs of 256 over 262,144 ids, the rope
# parameters); google/gemma.cpp pull request 919 (its E4B config: five
# sliding-window layers to one full, window 512, final logit cap 30,
# vocabulary 262,144); and an E4B fine-tune's config.json
# (FINAL-Bench/Darwin-4B-David: the same values, attention_k_eq_v false,
# tied word embeddings).
E4B_TEXT = dict(
    vocab_size=262_144, vocab_size_per_layer_input=262_144, hidden_size=2560,
    hidden_size_per_layer_input=256, intermediate_size=10_240, num_hidden_layers=42,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512,
    num_kv_shared_layers=18, sliding_window=512, final_logit_softcapping=30.0,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7,
    max_position_embeddings=131_072, attention_k_eq_v=False, tie_word_embeddings=True,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0,
                                        "partial_rotary_factor": 0.25}})
# The tiny model: E4B's structure (every layer's per-layer inputs in one table
# of 256 values a row, one K-quant block; KV-shared layers; sliding and full
# attention; both towers; tied lm_head) at a size the CPU runs in seconds.
TINY_TEXT = dict(
    vocab_size=512, vocab_size_per_layer_input=512, hidden_size=64,
    hidden_size_per_layer_input=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_kv_shared_layers=2,
    sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
    final_logit_softcapping=30.0, max_position_embeddings=4096)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                   position_embedding_size=64)
TINY_AUDIO = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
TINY_PLACEHOLDERS = dict(image_token_id=500, video_token_id=501, audio_token_id=502,
                         boi_token_id=503, eoi_token_id=504, boa_token_id=505,
                         eoa_token_index=506)
# Every matrix is this block of random bf16 values tiled over it, from a place
# of the block its name gives: an odd number of values, prime to 3, 5 and 7,
# so no row of a tensor (10,752, 2,560, 10,240 values ...) repeats another.
BLOCK_VALUES = 2**24 + 1
WEIGHT_STD = 0.02  # Gemma 4's initializer_range

GOAL_SPEED = 1.05  # TTFT and decode speed within this factor of transformers alone
DEFAULTS = {"prompt_tokens": 8500, "new_tokens": 64}
TINY_DEFAULTS = {"prompt_tokens": 64, "new_tokens": 8}
WARMUP_TOKENS = 32


@dataclass(frozen=True)
class Model:
    """A model the tool writes: its name in the marker, the files' shard size."""
    name: str
    shard_bytes: int


E4B = Model("gemma-4-E4B", 4 * 2**30)
TINY = Model("gemma-4-tiny", 512 * 2**10)  # several shards, as E4B's


# ---- arms ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Arm:
    name: str
    kind: str  # "transformers", "cpu-table" or "ple"
    row_cache_mib: int = 0
    qtype: str | None = None  # ple-TYPE: the GGUF copy's type

    @property
    def exact(self) -> bool:
        """Whether the arm computes with the checkpoint's own values (its
        tokens must be transformers')."""
        return self.qtype in (None, "bf16", "f32")


def parse_arms(text: str, device: str) -> list[Arm]:
    """The arms of ``--arms``; a ValueError naming what is wrong."""
    from ple_tools.quantize_table import TYPES

    arms = []
    for name in (part.strip() for part in text.split(",")):
        if name in ("transformers", "cpu-table", "ple"):
            arm = Arm(name, name)
        elif name.startswith("ple-cache:"):
            try:
                mib = positive_int(name.removeprefix("ple-cache:"))
            except argparse.ArgumentTypeError:
                raise ValueError(f"{name!r}: ple-cache:MIB takes an integer above 0 (MiB of "
                                 "row cache)") from None
            arm = Arm(name, "ple", row_cache_mib=mib)
        elif name.startswith("ple-") and name.removeprefix("ple-") in TYPES:
            arm = Arm(name, "ple", qtype=name.removeprefix("ple-"))
        else:
            raise ValueError(f"unknown {name!r}; arms: transformers, cpu-table, ple, "
                             f"ple-cache:MIB, ple-TYPE (TYPE: {', '.join(TYPES)})")
        if arm in arms:
            raise ValueError(f"{name!r} is named twice")
        if arm.kind == "cpu-table" and device == "cpu":
            raise ValueError("cpu-table moves the table from the GPU to the CPU; on the CPU "
                             "(--device cpu) the transformers arm is that already")
        arms.append(arm)
    return arms


# ---- the checkpoint -----------------------------------------------------------------

def gemma4_config(model: Model):
    """The Gemma4Config of ``model``: E4B's text model and transformers'
    default towers (which it documents as google/gemma-4-e2b-it's; E4B's
    model card gives its towers the same sizes, about 150M and 300M
    parameters), or the tiny one."""
    import torch
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    if model == TINY:
        config = Gemma4Config(text_config=Gemma4TextConfig(**TINY_TEXT),
                              vision_config=Gemma4VisionConfig(**TINY_VISION),
                              audio_config=Gemma4AudioConfig(**TINY_AUDIO), **TINY_PLACEHOLDERS)
    else:
        config = Gemma4Config(text_config=Gemma4TextConfig(**E4B_TEXT),
                              vision_config=Gemma4VisionConfig(),
                              audio_config=Gemma4AudioConfig())
    config.dtype = torch.bfloat16
    return config


def checkpoint_tensors(config) -> list[tuple[str, tuple[int, ...], torch.Tensor | None]]:
    """(name, shape, values) of each tensor the checkpoint holds, in the
    model's order: the state dict of ``Gemma4ForConditionalGeneration``
    built on the meta device, less the tied lm_head.  The tensors of fewer
    than 2 dimensions (norm scales, layer scalars, clipping bounds, biases)
    carry the values the model's own init gives them; the others None (a
    random block is tiled over them)."""
    import torch
    from transformers import Gemma4ForConditionalGeneration

    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration(config)
    for module in model.modules():
        owned = [(slots, name, tensor) for slots in (module._parameters, module._buffers)
                 for name, tensor in slots.items() if tensor is not None and tensor.dim() < 2]
        for slots, name, tensor in owned:
            value = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            slots[name] = (torch.nn.Parameter(value, requires_grad=False)
                           if slots is module._parameters else value)
        if owned:
            model._init_weights(module)  # the meta matrices beside them stay meta
    tied = set(model.all_tied_weights_keys)
    return [(name, tuple(tensor.shape), None if tensor.is_meta else tensor)
            for name, tensor in model.state_dict().items() if name not in tied]


class RandomBlock:
    """A block of random bf16 values that files are filled from."""

    def __init__(self, seed: int):
        import torch

        generator = torch.Generator().manual_seed(seed)
        values = torch.empty(BLOCK_VALUES).normal_(0, WEIGHT_STD, generator=generator)
        self.bytes = memoryview(values.to(torch.bfloat16).view(torch.uint8).numpy())

    def write(self, handle, nbytes: int, start: int) -> None:
        """Writes ``nbytes`` of the block tiled from value ``start``."""
        position = 2 * (start % BLOCK_VALUES)
        while nbytes:
            take = min(nbytes, len(self.bytes) - position)
            handle.write(self.bytes[position:position + take])
            nbytes -= take
            position = 0


def _nbytes(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return 2 * count  # bf16


def group_into_shards(tensors, shard_bytes: int) -> list[list]:
    """The tensors grouped into shards of at most ``shard_bytes`` (a larger
    tensor alone), in order."""
    shards, size = [[]], 0
    for entry in tensors:
        nbytes = _nbytes(entry[1])
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def shard_file(i: int, count: int) -> str:
    return f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def write_shard(path: Path, tensors, block: RandomBlock) -> None:
    """One safetensors file of bf16 tensors, written as it goes (a matrix is
    never in memory) and flushed to the disk, so that its pages can be
    dropped from the page cache."""
    import torch

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in tensors:
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + _nbytes(shape)]}
        offset += _nbytes(shape)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text)
        for name, shape, value in tensors:
            if value is not None:
                handle.write(value.to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy())
            else:
                block.write(handle, _nbytes(shape), zlib.crc32(name.encode()))
        handle.flush()
        os.fsync(handle.fileno())


def plan_checkpoint(model: Model) -> tuple:
    """The config of ``model``, its tensors in shards, and the shards' file names."""
    config = gemma4_config(model)
    shards = group_into_shards(checkpoint_tensors(config), model.shard_bytes)
    names = [shard_file(i, len(shards)) for i in range(len(shards))]
    return config, shards, names


def config_digest(config) -> str:
    """The SHA-256 of ``config`` as config.json holds it, less the version of
    transformers that writes it."""
    fields = {k: v for k, v in config.to_dict().items() if k != "transformers_version"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def checkpoint_info(config, shards, names: list[str], model: Model, seed: int) -> dict:
    """What the marker records of a checkpoint: its model, config, sizes and table."""
    (rows, cols), = [shape for shard in shards for name, shape, _ in shard if name == TABLE]
    return {"model": model.name, "config": config_digest(config), "seed": seed,
            "shards": len(names),
            "bytes": sum(_nbytes(shape) for shard in shards for _, shape, _ in shard),
            "table_rows": rows, "table_cols": cols, "table_bytes": _nbytes((rows, cols))}


def reusable_checkpoint(directory: Path, model: Model, seed: int) -> dict | None:
    """The record of the checkpoint in ``directory`` if this tool wrote it
    whole for ``model`` (its config as this tool makes it) and ``seed``;
    raises ForeignFilesError for a directory holding files it did not
    write."""
    marker = directory / INFO
    record = written.read_record(marker, TOOL)
    written.refuse_foreign(directory, marker, record, WHAT)
    if (record is not None and record["complete"]
            and (record.get("model"), record.get("config"), record.get("seed"))
            == (model.name, config_digest(gemma4_config(model)), seed)
            and all((directory / name).is_file() for name in record["files"])):
        return record
    return None


def refuse_without_room(directory: Path, need: int, what: str, freed: list[str]) -> None:
    """A RuntimeError where the filesystem of ``directory`` has less than
    ``need`` bytes free once the files ``freed`` (of ``directory``) are
    deleted."""
    existing = directory.resolve()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free + sum(
        (directory / name).stat().st_size for name in freed if (directory / name).is_file())
    if need > free:
        raise RuntimeError(f"{directory}: {what} takes {size(need)}, and its filesystem has "
                           f"{size(free)} free")


def write_checkpoint(directory: Path, model: Model, seed: int) -> dict:
    """Writes the checkpoint of ``model`` into ``directory`` and returns its
    record (also in its ple_bench.json).  Raises ForeignFilesError, and a
    RuntimeError where the disk has too little room, before deleting or
    writing anything: ForeignFilesError when ``directory`` holds a file that
    its ple_bench.json does not list."""
    marker = directory / INFO
    record = written.read_record(marker, TOOL)
    written.refuse_foreign(directory, marker, record, WHAT)
    config, shards, names = plan_checkpoint(model)
    files = [*names, INDEX_FILE, "config.json"]
    info = checkpoint_info(config, shards, names, model, seed)
    refuse_without_room(directory, info["bytes"], f"the {model.name} checkpoint",
                        record["files"] if record else [])
    written.begin(directory, marker, TOOL, record, files)
    block = RandomBlock(seed)
    weight_map = {}
    for name, shard in zip(names, shards):
        write_shard(directory / name, shard, block)
        weight_map.update({tensor: name for tensor, _, _ in shard})
    index = {"metadata": {"total_size": info["bytes"]},
             "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    config.save_pretrained(directory)
    written.finish(marker, TOOL, files, **info, copies={})
    return written.read_record(marker, TOOL)


def gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def size(nbytes: int) -> str:
    """``nbytes`` in GiB, or MiB below 1 GiB."""
    return f"{gib(nbytes)} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def copy_name(qtype: str) -> str:
    return f"per-layer-table-{qtype}.gguf"


def copy_bytes(record: dict, qtype: str) -> int:
    """About what the GGUF copy of the table in ``qtype`` takes: its rows."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype.upper()]]
    return record["table_rows"] * record["table_cols"] // block * block_bytes


def ensure_copy(directory: Path, record: dict, qtype: str) -> tuple[dict, bool]:
    """The record with the table's ``qtype`` GGUF copy beside the checkpoint,
    written by ple-quantize-table unless it is there; and whether it was
    written.  The marker lists the file before it is written (so that a
    later run may replace it) and names it as the copy once it is whole.  A
    RuntimeError where the disk has too little room or the tool fails.  The
    tool runs in a process of its own: this one keeps off ple's native part
    and the GPU."""
    from ple_tools.arm_child import module_command

    marker = directory / INFO
    name = copy_name(qtype)
    if record["copies"].get(qtype) == name and (directory / name).is_file():
        return record, False
    refuse_without_room(directory, copy_bytes(record, qtype), f"the {qtype} copy of the table",
                        [name])
    fields = {k: v for k, v in record.items() if k not in ("written_by", "complete", "files")}
    files = sorted({*record["files"], name})
    written.write_record(marker, {"written_by": TOOL, "complete": True, "files": files, **fields})
    status = subprocess.run(module_command("ple_tools.quantize_table", str(directory),
                                           str(directory / name), "--type", qtype, "--force"),
                            stdout=sys.stderr).returncode
    if status != 0:
        raise RuntimeError(f"ple-quantize-table could not write the {qtype} copy of the table "
                           f"(exit status {status}; its message is above)")
    fields["copies"] = {**record["copies"], qtype: name}
    written.finish(marker, TOOL, files, **fields)
    return written.read_record(marker, TOOL), True


def drop_page_cache(directory: Path) -> None:
    """Evicts the checkpoint's and the copies' pages from the page cache."""
    from ple_tools.bench_transformers import drop_page_cache as drop

    drop(directory, "*.safetensors")
    drop(directory, "*.gguf")


# ---- one arm, in a child process ----------------------------------------------------

def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM and RssAnon of this process, in bytes."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def reset_peak_rss() -> None:
    """Sets VmHWM to the current VmRSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Phases:
    """What each phase of an arm (load, prefill, decode) took: its peaks
    since the phase began, and its state at its end; with ple's tables, their
    counters in the phase."""

    def __init__(self, device: torch.device):
        self.device, self.tables, self.records = device, {}, {}

    def count(self, tables: dict) -> None:
        """Counts the gathers of ``tables`` (ple's, by module name) in this
        phase and the next ones."""
        self.tables = tables

    def begin(self) -> None:
        from ple_tools.bench_transformers import disk_read_bytes

        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        for table in self.tables.values():
            table.reset_stats()
        reset_peak_rss()
        self.read_bytes = disk_read_bytes()

    def end(self, phase: str) -> None:
        from ple_tools.bench_transformers import disk_read_bytes

        record = {}
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            record.update(gpu_peak=torch.cuda.max_memory_allocated(self.device),
                          gpu_end=torch.cuda.memory_allocated(self.device),
                          gpu_reserved_peak=torch.cuda.max_memory_reserved(self.device),
                          device_used=total - free)
        status = proc_status()
        record.update(rss_end=status["VmRSS"], rss_peak=status["VmHWM"],
                      rss_anon_end=status["RssAnon"],
                      read_bytes=disk_read_bytes() - self.read_bytes)
        if self.tables:
            stats = [table.stats() for table in self.tables.values()]
            record["ple"] = {key: sum(s[key] for s in stats) for key in stats[0]}
        self.records[phase] = record


def move_table_to_cpu(model, device: torch.device) -> None:
    """The workaround of transformers issue 47705: the per-layer table's
    module moved to the CPU, the ids sent to it and its rows brought back to
    ``device`` by hooks, the GPU memory it held given back to the driver."""
    import torch

    module = model.get_submodule(TABLE_MODULE)
    module.to("cpu")
    module.register_forward_pre_hook(lambda _, args: (args[0].to("cpu"), *args[1:]))
    module.register_forward_hook(lambda _, args, rows: rows.to(device))
    torch.cuda.empty_cache()


def first_token_streamer(phases: Phases):
    """A generate() streamer that notes when each token comes and ends the
    prefill phase (beginning the decode phase) at the first new token."""
    from ple_tools.bench_transformers import TokenTimes

    class FirstToken(TokenTimes):
        def put(self, value) -> None:
            super().put(value)
            if len(self.times) == 2:  # the prompt, then the first new token
                phases.end("prefill")
                phases.begin()

    return FirstToken()


def load(spec: dict, device: torch.device):
    """The arm's model on ``device``, as the arm loads it."""
    import torch
    from transformers import AutoModelForCausalLM

    directory = Path(spec["dir"])
    options = {"dtype": torch.bfloat16, "device_map": str(device)}
    if spec["kind"] != "ple":
        model = AutoModelForCausalLM.from_pretrained(directory, **options)
        if spec["kind"] == "cpu-table":
            move_table_to_cpu(model, device)
        return model
    from ple import GatherConfig
    from ple.integrations.transformers import from_pretrained

    if spec["row_cache_mib"]:
        options["gather_config"] = GatherConfig(row_cache_mib=spec["row_cache_mib"])
    if spec["table_file"]:
        options["table_file"] = directory / spec["table_file"]
    return from_pretrained(AutoModelForCausalLM, directory, **options)


def prompt_ids(config, count: int, seed: int):
    """Random ids below the first of the placeholders (image, audio, ...)
    that the model treats apart."""
    import torch

    text = config.get_text_config()
    below = min([text.vocab_size, *(getattr(config, key) for key in (
        "image_token_id", "video_token_id", "audio_token_id", "boi_token_id", "eoi_token_id",
        "boa_token_id") if isinstance(getattr(config, key, None), int))])
    return torch.randint(3, below, (1, count), generator=torch.Generator().manual_seed(seed))


def run_arm(spec: dict) -> dict:
    """One arm, in this process: load, warm up, generate from the cold prompt."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = torch.device(spec["device"])
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.init()
    phases = Phases(device)
    phases.begin()
    start = time.perf_counter()
    model = load(spec, device)
    if spec["kind"] == "ple":
        from ple.integrations.transformers import tables

        phases.count(tables(model))  # their counters since they were opened: the load's
    phases.end("load")
    load_s = time.perf_counter() - start
    prompt = prompt_ids(model.config, spec["prompt_tokens"], spec["seed"]).to(device)
    warmup = prompt_ids(model.config, min(WARMUP_TOKENS, spec["prompt_tokens"]),
                        spec["seed"] + 1).to(device)
    options = {"do_sample": False, "pad_token_id": 0}
    if spec["prefill_chunk"]:
        options["prefill_chunk_size"] = spec["prefill_chunk"]
    new = spec["new_tokens"]
    with torch.inference_mode():
        model.generate(warmup, attention_mask=torch.ones_like(warmup), max_new_tokens=2,
                       min_new_tokens=2, **options)
        drop_page_cache(Path(spec["dir"]))
        if spec["kind"] == "ple":
            for table in tables(model).values():
                table.drop_page_cache()  # the pages it maps stay cached otherwise
        phases.begin()
        streamer = first_token_streamer(phases)
        start = time.perf_counter()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=1 + new, min_new_tokens=1 + new, streamer=streamer,
                             **options)
        phases.end("decode")
    steps = streamer.intervals_ms()
    tokens = out[0, prompt.shape[1]:].tolist()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return {"arm": spec["arm"], "device": f"{device} ({name})", "load_s": load_s,
            "ttft_s": streamer.times[1] - start, "decode_ms": steps,
            "decode_tok_s": 1000 / statistics.median(steps), "tokens": tokens,
            "sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
            "phases": phases.records}


def child_main(spec_json: str) -> None:
    from ple_tools.arm_child import write_line

    spec = json.loads(spec_json)
    write_line(spec, run_arm(spec))


# ---- the run ------------------------------------------------------------------------

def prepare(args, arms: list[Arm]) -> dict:
    """The checkpoint and the copies the arms read, written where they are
    not there yet; raises RuntimeError where the disk has too little room."""
    model = TINY if args.tiny else E4B
    start = time.perf_counter()
    record = reusable_checkpoint(args.dir, model, args.seed)
    if record is None:
        record = write_checkpoint(args.dir, model, args.seed)
        seconds = time.perf_counter() - start
        how = f"written in {seconds:.1f} s ({record['bytes'] / seconds / 1e9:.2f} GB/s)"
    else:
        how = "reused"
    print(f"checkpoint {args.dir}: {model.name}, {size(record['bytes'])} in {record['shards']} "
          f"files, the per-layer table {record['table_rows']:,} x {record['table_cols']:,} bf16 "
          f"({size(record['table_bytes'])}) ({how})", flush=True)
    for qtype in (arm.qtype for arm in arms if arm.qtype):
        start = time.perf_counter()
        record, wrote = ensure_copy(args.dir, record, qtype)
        nbytes = (args.dir / copy_name(qtype)).stat().st_size
        how = f"written in {time.perf_counter() - start:.1f} s" if wrote else "reused"
        print(f"  {copy_name(qtype)}: {size(nbytes)} ({how})", flush=True)
    return record


def run_turns(args, arms: list[Arm]) -> list[dict]:
    from ple_tools.arm_child import run_child

    results = []
    for turn in range(1, args.rounds + 1):
        for arm in arms:
            drop_page_cache(args.dir)
            spec = {"arm": arm.name, "kind": arm.kind, "row_cache_mib": arm.row_cache_mib,
                    "table_file": copy_name(arm.qtype) if arm.qtype else None,
                    "dir": str(args.dir), "device": args.device,
                    "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                    "prefill_chunk": args.prefill_chunk, "seed": args.seed}
            run = run_child("ple_tools.bench_gemma4", spec, args.timeout)
            if run.timed_out:
                record = {"arm": arm.name, "failed": f"killed after {args.timeout:.0f} s "
                                                     "(--timeout)"}
            elif run.code != 0 or not run.lines:
                record = {"arm": arm.name, "failed": f"exited with status {run.code} (its "
                                                     "error is above)"}
            else:
                record = run.lines[-1]
            results.append({**record, "round": turn, "seconds": run.seconds})
            print(f"  round {turn} {arm.name}: "
                  + (record["failed"] if "failed" in record else progress(record))
                  + f" ({run.seconds:.0f} s)", file=sys.stderr, flush=True)
    return results


def progress(record: dict) -> str:
    """An arm's figures in one line, as it ends (what a run cut short keeps)."""
    phases = record["phases"]
    gpu = (f"GPU {gib(phases['load']['gpu_end'])} GiB after load, peaks "
           f"{gib(phases['prefill']['gpu_peak'])} prefill, {gib(phases['decode']['gpu_peak'])} "
           "decode; " if "gpu_end" in phases["load"] else "")
    return (f"load {record['load_s']:.1f} s; {gpu}RSS {gib(phases['decode']['rss_end'])} GiB at "
            f"the end; TTFT {record['ttft_s']:.3f} s; {record['decode_tok_s']:.1f} tokens/s; "
            f"tokens {record['sha256'][:16]}")


def medians(results: list[dict]) -> dict[str, dict]:
    """Per arm, the median over its rounds of each figure the goals use."""
    figures = {}
    for arm in dict.fromkeys(r["arm"] for r in results if "failed" not in r):
        runs = [r for r in results if r["arm"] == arm and "failed" not in r]

        def median(phase, key):
            values = [r["phases"][phase].get(key) for r in runs]
            return statistics.median(values) if None not in values else None

        figures[arm] = {"ttft_s": statistics.median(r["ttft_s"] for r in runs),
                        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs)}
        for phase in ("load", "prefill", "decode"):
            for key in ("gpu_peak", "gpu_end", "device_used", "rss_end", "rss_peak"):
                figures[arm][f"{phase}_{key}"] = median(phase, key)
    return figures


def goals(figures: dict[str, dict], table_bytes: int, arms: list[Arm]) -> list[dict]:
    """Each ple arm against the goals, where the arms they compare with ran."""
    checks = []
    for arm in arms:
        mine = figures.get(arm.name)
        if arm.kind != "ple" or mine is None:
            continue
        workaround, alone = figures.get("cpu-table"), figures.get("transformers")
        if workaround is not None and mine["load_gpu_end"] is not None:
            keys = [("load_gpu_end", "GPU after load"), ("prefill_gpu_peak", "prefill peak"),
                    ("decode_gpu_peak", "decode peak"), ("decode_device_used", "device used")]
            checks.append({"arm": arm.name, "goal": "GPU memory <= cpu-table's",
                           "met": all(mine[k] <= workaround[k] for k, _ in keys),
                           "detail": ", ".join(f"{what} {gib(mine[k])} vs {gib(workaround[k])} GiB"
                                               for k, what in keys)})
        if workaround is not None:
            bound = workaround["decode_rss_end"] - table_bytes
            peak = max(workaround["prefill_rss_peak"], workaround["decode_rss_peak"]) - table_bytes
            mine_peak = max(mine["prefill_rss_peak"], mine["decode_rss_peak"])
            checks.append({"arm": arm.name, "goal": "RSS <= cpu-table's less the table",
                           "met": mine["decode_rss_end"] <= bound and mine_peak <= peak,
                           "detail": f"at the end {gib(mine['decode_rss_end'])} vs "
                                     f"{gib(bound)}, peak {gib(mine_peak)} vs {gib(peak)} GiB"})
        if alone is not None:
            ratio = mine["ttft_s"] / alone["ttft_s"]
            checks.append({"arm": arm.name, "goal": f"TTFT <= {GOAL_SPEED}x transformers'",
                           "met": ratio <= GOAL_SPEED,
                           "detail": f"{mine['ttft_s']:.3f} vs {alone['ttft_s']:.3f} s "
                                     f"({ratio:.2f}x)"})
            ratio = alone["decode_tok_s"] / mine["decode_tok_s"]
            checks.append({"arm": arm.name, "goal": f"decode within {GOAL_SPEED}x of "
                                                    "transformers'",
                           "met": ratio <= GOAL_SPEED,
                           "detail": f"{mine['decode_tok_s']:.1f} vs {alone['decode_tok_s']:.1f} "
                                     f"tokens/s ({ratio:.2f}x the time a token)"})
    return checks


def token_groups(results: list[dict], arms: list[Arm]) -> tuple[bool, list[str]]:
    """Whether the runs that must agree did, and a line per group: the arms
    with the checkpoint's values together, each quantized copy's apart."""
    by_name = {arm.name: arm for arm in arms}
    groups: dict[str, list[dict]] = {}
    for r in results:
        if "failed" not in r:
            arm = by_name[r["arm"]]
            groups.setdefault("exact" if arm.exact else arm.qtype, []).append(r)
    reference = groups.get("exact", [{}])[0].get("tokens")
    ok, lines = True, []
    for group, runs in groups.items():
        hashes = sorted({r["sha256"] for r in runs})
        names = ", ".join(dict.fromkeys(r["arm"] for r in runs))
        same = len(hashes) == 1
        ok &= same
        line = (f"  {names}: sha256 {hashes[0][:16]} ({len(runs[0]['tokens'])} tokens)"
                if same else f"  {names}: TOKENS DIFFER: " + ", ".join(
                    f"{r['arm']} round {r['round']} {r['sha256'][:16]}" for r in runs))
        if group != "exact":
            line += f", a {group} copy of the table: compared with its own runs only"
            if reference is not None and same:
                equal = sum(a == b for a, b in zip(runs[0]["tokens"], reference))
                line += f" ({equal} of {len(reference)} tokens equal the bf16 arms')"
        lines.append(line)
    return ok, lines


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def report(results: list[dict], arms: list[Arm], record: dict, cuda: bool) -> tuple[bool, dict]:
    done = [r for r in results if "failed" not in r]
    print(f"\ndevice: {', '.join(sorted({r['device'] for r in done})) or 'none'}")
    for r in results:
        if "failed" in r:
            print(f"round {r['round']} {r['arm']}: failed: {r['failed']}")
    if cuda and done:
        print("GPU memory, GiB (torch's allocated: peak in the phase / at its end; device: "
              "used on the GPU at the phase's end)")
        print(f"{'arm':<16}{'round':>6}{'load peak':>11}{'load end':>10}{'prefill pk':>12}"
              f"{'decode pk':>11}{'device load':>13}{'prefill':>9}{'decode':>8}")
        for r in done:
            p = r["phases"]
            print(f"{r['arm']:<16}{r['round']:>6}{gib(p['load']['gpu_peak']):>11}"
                  f"{gib(p['load']['gpu_end']):>10}{gib(p['prefill']['gpu_peak']):>12}"
                  f"{gib(p['decode']['gpu_peak']):>11}{gib(p['load']['device_used']):>13}"
                  f"{gib(p['prefill']['device_used']):>9}{gib(p['decode']['device_used']):>8}")
        print()
    if done:
        print("host memory, GiB (VmRSS at the phase's end, VmHWM in the phase; anon: RssAnon)")
        print(f"{'arm':<16}{'round':>6}{'load end':>10}{'load pk':>9}{'prefill pk':>12}"
              f"{'decode pk':>11}{'end':>7}{'anon end':>10}")
        for r in done:
            p = r["phases"]
            print(f"{r['arm']:<16}{r['round']:>6}{gib(p['load']['rss_end']):>10}"
                  f"{gib(p['load']['rss_peak']):>9}{gib(p['prefill']['rss_peak']):>12}"
                  f"{gib(p['decode']['rss_peak']):>11}{gib(p['decode']['rss_end']):>7}"
                  f"{gib(p['decode']['rss_anon_end']):>10}")
        print()
        print("speed and reads (prompt: from the generate call to the first token; MiB read "
              "from the disk in it; ple: the table's rows, pages and bytes copied in it)")
        print(f"{'arm':<16}{'round':>6}{'load s':>8}{'TTFT s':>9}{'tokens/s':>10}"
              f"{'prompt MiB':>12}{'ple rows':>10}{'pages':>9}{'MiB copied':>12}")
        for r in done:
            prefill = r["phases"]["prefill"]
            counters = prefill.get("ple")
            ple = (f"{counters['rows']:>10,}{counters['unique_pages']:>9,}"
                   f"{counters['bytes_copied'] / 2**20:>12.1f}" if counters else "")
            print(f"{r['arm']:<16}{r['round']:>6}{r['load_s']:>8.1f}{r['ttft_s']:>9.3f}"
                  f"{r['decode_tok_s']:>10.1f}{prefill['read_bytes'] / 2**20:>12.1f}{ple}")
        print()
    ok, lines = token_groups(results, arms)
    print("tokens:" if lines else "tokens: no arm finished")
    print("\n".join(lines))
    figures = medians(results)
    checks = goals(figures, record["table_bytes"], arms) if cuda else []
    if checks:
        rounds = len({r["round"] for r in done})
        print(f"\ngoals ({'medians over the rounds' if rounds > 1 else 'one round'}):")
        for check in checks:
            print(f"  {check['arm']}: {check['goal']}: {'met' if check['met'] else 'MISSED'} "
                  f"({check['detail']})")
    elif not cuda:
        print("\ngoals: on a GPU only (--device cuda)")
    return ok and len(done) == len(results), {"medians": figures, "goals": checks}


def run(args, arms: list[Arm]) -> tuple[int, dict]:
    import torch

    try:
        record = prepare(args, arms)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2, {}
    # The GPU is the children's alone: this process leaves CUDA uninitialized.
    print(f"machine: {os.cpu_count()} CPUs, {mem_total() / 2**30:.0f} GiB, torch "
          f"{torch.__version__}; "
          f"{args.prompt_tokens:,} prompt tokens"
          + (f" in chunks of {args.prefill_chunk:,}" if args.prefill_chunk else " in one forward")
          + f", {args.new_tokens} new tokens, {args.rounds} round(s)", flush=True)
    results = run_turns(args, arms)
    ok, summary = report(results, arms, record, args.device == "cuda")
    info = {k: v for k, v in record.items() if k not in ("written_by", "complete")}
    return (0 if ok else 1), {"checkpoint": info, "results": results, **summary}


def parse_args(argv=None) -> tuple[argparse.Namespace, list[Arm]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", action=OutputDirectory, default=Path("data/bench_gemma4"),
                        help="the checkpoint's directory: reused if this tool wrote the same "
                        "model there, else written there; a directory holding files it did not "
                        "write is refused (default data/bench_gemma4)")
    parser.add_argument("--arms", help="comma separated: transformers, cpu-table, ple, "
                        "ple-cache:MIB, ple-TYPE (default transformers,cpu-table,ple,ple-q5_k; "
                        "on the CPU transformers,ple,ple-q5_k)")
    parser.add_argument("--prompt-tokens", type=positive_int,
                        help=f"the prompt's tokens (default {DEFAULTS['prompt_tokens']}; "
                        f"{TINY_DEFAULTS['prompt_tokens']} with --tiny)")
    parser.add_argument("--new-tokens", type=positive_int,
                        help=f"decode steps after the first token (default "
                        f"{DEFAULTS['new_tokens']}; {TINY_DEFAULTS['new_tokens']} with --tiny)")
    parser.add_argument("--prefill-chunk", type=non_negative_int, default=0,
                        help="generate's prefill_chunk_size (default 0: the prompt in one "
                        "forward, as transformers does by default)")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="turns of the arms (default 1)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where the model runs (default cuda; cpu only with --tiny)")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model of E4B's structure, for tests (runs on the CPU)")
    parser.add_argument("--seed", type=seed, default=0, help="of the weights and prompts "
                        "(default 0)")
    parser.add_argument("--timeout", type=positive_float, default=600,
                        help="seconds an arm may take (default 600)")
    add_json_option(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return args, []
    for key, value in (TINY_DEFAULTS if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device == "cpu" and not args.tiny:
        parser.error("argument --device: cpu runs only the tiny model (--tiny): E4B on the CPU "
                     "measures nothing this tool is for")
    limit = (TINY_TEXT if args.tiny else E4B_TEXT)["max_position_embeddings"]
    if args.prompt_tokens + 1 + args.new_tokens > limit:
        parser.error(f"argument --prompt-tokens: {args.prompt_tokens} prompt tokens and "
                     f"{1 + args.new_tokens} new ones pass the model's {limit:,} positions")
    if args.prefill_chunk > args.prompt_tokens:
        parser.error(f"argument --prefill-chunk: {args.prefill_chunk} is longer than the prompt "
                     f"({args.prompt_tokens} tokens)")
    default_arms = ("transformers,ple,ple-q5_k" if args.device == "cpu"
                    else "transformers,cpu-table,ple,ple-q5_k")
    try:
        arms = parse_arms(args.arms or default_arms, args.device)
    except ValueError as error:
        parser.error(f"argument --arms: {error}")
    return args, arms


def main(argv=None) -> int:
    args, arms = parse_args(argv)
    if args.child:
        child_main(args.child)
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA device: ple-bench-gemma4 measures a GPU (--tiny --device cpu "
                  "runs the tiny model on the CPU)", file=sys.stderr)
            return 2
    return run_recorded(args, "bench_gemma4", argv, lambda: run(args, arms))


if __name__ == "__main__":
    sys.exit(main())
