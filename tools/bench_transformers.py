"""A transformers Qwen4Exp model whose n-gram tables are several GiB: load
time, peak memory, time to first token and per-token time, with the tables
served by ple, held in memory, and offloaded to disk by transformers.

    python tools/bench_transformers.py [--dir data/bench_transformers] [--table-gib 3]
                                       [--arms ple,in-memory,disk-offload] [--json PATH]

The checkpoint is a tiny Qwen4Exp text model (random weights) whose PLE
layers have n-gram tables of ``--table-gib`` GiB in all, written as shard
families ``....ngram_embedding.shard_{i}.weight`` one shard at a time; a
directory that already holds one of that size is reused, and one that holds
files the tool did not write is refused (its ``ple_bench.json`` lists the
files it wrote, the only ones it deletes).  Each arm runs in
a subprocess of its own, after the checkpoint's pages have been dropped
from the page cache (the first token is cold, as after a reboot):

- ``ple``: ``ple.integrations.transformers.from_pretrained``; the tables stay
  in the checkpoint's files and ple gathers the rows each step needs;
- ``in-memory``: ``Qwen4ExpForCausalLM.from_pretrained``, which concatenates
  each table in memory (skipped when the machine has too little memory);
- ``disk-offload``: ``from_pretrained`` with a ``device_map`` sending the
  tables to ``"disk"`` (needs accelerate): transformers concatenates each
  table in memory and writes it to an offload folder as a safetensors file
  (a copy of the table), which accelerate's hook opens at each forward
  (safetensors maps it, so the lookup reads the rows it needs).

``load s`` is the ``from_pretrained`` call, ``peak RSS`` the process's
VmHWM less its resident memory before loading, ``first token s`` a greedy
``generate`` of one token after ``--prompt`` tokens (the first call, cold).
After a warm-up ``generate`` of other tokens, ``ms/token`` is the median
time of the ``--new-tokens`` decode steps of a ``generate`` of new tokens
(rows never read before: from the disk for ple), and ``again`` the same for
a repeat of that ``generate`` (the same rows, now in the page cache), and
``disk read`` what the process read from the disk.  Every arm must generate
the same tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

from ple_tools import written
from ple_tools.argtypes import (OutputDirectory, int_range, positive_float, positive_int, seconds,
                                seed)
from ple_tools.figures import add_json_option, run_recorded

if TYPE_CHECKING:  # for annotations; torch is imported after parsing (--help imports none)
    import torch

ARMS = ("ple", "in-memory", "disk-offload")
DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
MODEL_CONFIG = dict(
    vocab_size=4096, hidden_size=128, num_hidden_layers=3,
    layer_types=["linear_attention", "linear_attention", "indexed_attention"],
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=8,
    indexer_compress_ratio=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
    linear_num_value_heads=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    num_experts=4, num_experts_per_tok=2, hc_count=2, hc_lowrank=16, ple_layer_ids=[1, 2],
    ple_embed_dim=256, ngram_size=3, heads_per_ngram=2, eos_token_id=1, pad_token_id=0,
    bos_token_id=2, max_position_embeddings=32768)
# PLE layers go on linear-attention layers only (the first ones).
MOST_PLE_LAYERS = MODEL_CONFIG["layer_types"].count("linear_attention")
INFO = "ple_bench.json"  # the checkpoint's marker (ple_tools.written)
TOOL = "ple-bench-transformers"
WHAT = "a checkpoint"
SMALL_FILE = "model-small.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def qwen4exp_config(table_bytes: float | None, *, ple_layers: int, shards: int,
                    dtype: torch.dtype, **overrides):
    """A tiny Qwen4ExpTextConfig whose ``ple_layers`` n-gram tables hold
    about ``table_bytes`` in all (``ngram_vocab_size_base`` sized to it;
    None: the smallest, a base of 1000)."""
    from transformers import Qwen4ExpTextConfig

    fields = {**MODEL_CONFIG, "ple_layer_ids": list(range(1, ple_layers + 1)), **overrides}
    heads = (fields["ngram_size"] - 1) * fields["heads_per_ngram"]
    row_bytes = fields["ple_embed_dim"] // heads * dtype.itemsize
    base = 1000 if table_bytes is None else max(1000, int(table_bytes / ple_layers / heads
                                                          / row_bytes))
    config = Qwen4ExpTextConfig(**fields, ngram_vocab_size_base=base, split_ngram_parts=shards)
    config.dtype = dtype
    return config


def write_checkpoint(directory: Path, table_bytes: float, *, ple_layers: int = 2, shards: int = 8,
                     dtype: torch.dtype | None = None, seed: int = 0, sync: bool = False,
                     **overrides) -> dict:
    """Writes a Qwen4Exp checkpoint whose n-gram tables hold about
    ``table_bytes``, holding one shard in memory at a time: the small weights
    are those ``save_pretrained`` writes for a model of the same shape but
    tiny tables, the tables are random shards written one file each, and an
    index lists them all.  ``sync``: flush each file to the disk (so that
    its pages can be dropped from the page cache).  Returns what it wrote
    (also in ple_bench.json, which lists the files: see ple_tools.written).
    ``dtype``: of the stored rows (default bfloat16).  Raises
    ple_tools.written.ForeignFilesError, before deleting or writing anything,
    when ``directory`` holds a file that its ple_bench.json does not list."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen4ExpForCausalLM

    dtype = torch.bfloat16 if dtype is None else dtype

    config = qwen4exp_config(table_bytes, ple_layers=ple_layers, shards=shards, dtype=dtype,
                             **overrides)
    small_config = qwen4exp_config(None, ple_layers=ple_layers, shards=shards, dtype=dtype,
                                   **overrides)
    marker = directory / INFO
    record = written.read_record(marker, TOOL, _legacy_record)
    written.refuse_foreign(directory, marker, record, WHAT)
    # The big model on the meta device: its n-gram modules' sizes and buffers.
    with torch.device("meta"):
        big = Qwen4ExpForCausalLM(config)
    ngram_modules = [(name, module) for name, module in big.named_modules()
                     if type(module).__name__ == "Qwen4ExpTextNGramEmbedding"]
    names = [*(_shard_file(f"{name}.ngram_embedding", i) for name, _ in ngram_modules
               for i in range(shards)), SMALL_FILE, INDEX_FILE, "config.json"]
    written.begin(directory, marker, TOOL, record, names, what=WHAT)
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as scratch:
        Qwen4ExpForCausalLM(small_config).to(dtype).save_pretrained(scratch)
        weights = {}
        for file in Path(scratch).glob("*.safetensors"):
            weights.update(load_file(file))
    weight_map, total, tables = {}, 0, {}
    generator = torch.Generator().manual_seed(seed + 1)
    for name, module in ngram_modules:
        for key in [k for k in weights if k.startswith(f"{name}.")]:
            del weights[key]
        weights[f"{name}.layer_multipliers"] = _layer_multipliers(module)
        weights[f"{name}.ngram_heads_vocab_sizes"] = torch.tensor(module.head_vocab_sizes)
        weights[f"{name}.ngram_heads_offsets"] = torch.tensor(module.head_offsets)
        rows, cols = module.ngram_embedding.num_embeddings, module.ngram_embedding.embedding_dim
        per_shard = -(-rows // shards)
        prefix = f"{name}.ngram_embedding"
        for i in range(shards):
            n = max(0, min(per_shard, rows - i * per_shard))
            shard = torch.empty(n, cols).normal_(0, 0.02, generator=generator).to(dtype)
            file = _shard_file(prefix, i)
            save_file({f"{prefix}.shard_{i}.weight": shard}, str(directory / file))
            if sync:
                _fsync(directory / file)
            weight_map[f"{prefix}.shard_{i}.weight"] = file
            total += shard.nbytes
            del shard
        tables[prefix] = [rows, cols]
    save_file(weights, str(directory / SMALL_FILE))
    weight_map.update(dict.fromkeys(weights, SMALL_FILE))
    total += sum(t.nbytes for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    config.save_pretrained(directory)
    info = {"table_bytes": sum(r * c * dtype.itemsize for r, c in tables.values()),
            "tables": tables, "dtype": str(dtype).removeprefix("torch."),
            "requested_bytes": table_bytes, "ple_layers": ple_layers, "shards": shards,
            "seed": seed}
    if sync:
        _fsync(directory / SMALL_FILE)
    written.finish(marker, TOOL, names, what=WHAT, **info)
    return info


def _shard_file(prefix: str, i: int) -> str:
    return f"{prefix.replace('.', '-')}-{i:05d}.safetensors"


def _legacy_record(data: object) -> dict | None:
    """A record of the ple_bench.json written before it listed its files
    (after them): the files are those its tables and shards name."""
    try:
        files = [_shard_file(prefix, i) for prefix in data["tables"]
                 for i in range(data["shards"])]
    except (TypeError, KeyError):
        return None
    return {**data, "complete": True, "files": [*files, SMALL_FILE, INDEX_FILE, "config.json"]}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _layer_multipliers(module) -> torch.Tensor:
    from transformers.models.qwen4_exp.modeling_qwen4_exp import _build_layer_multipliers

    return _build_layer_multipliers(module.unigram_vocab_size, module.ngram_size,
                                    module.ple_layer_index, module.seed)


def ensure_checkpoint(directory: Path, table_bytes: float, dtype: torch.dtype,
                      ple_layers: int = 2) -> dict:
    """The checkpoint in ``directory`` if it was written for this size, dtype
    and number of PLE layers, to the end, else a new one (write_checkpoint,
    which refuses a directory holding files it did not write)."""
    record = existing_checkpoint(directory, table_bytes, str(dtype).removeprefix("torch."),
                                 ple_layers)
    if record is not None:
        return {key: value for key, value in record.items()
                if key not in ("written_by", "what", "complete", "files")}
    return write_checkpoint(directory, table_bytes, dtype=dtype, ple_layers=ple_layers, sync=True)


def existing_checkpoint(directory: Path, table_bytes: float, dtype: str,
                        ple_layers: int) -> dict | None:
    """The record of the checkpoint in ``directory`` if it was written for
    this size, dtype ("bfloat16") and number of PLE layers, to the end;
    else None, once it is sure that one can be written there: raises
    ple_tools.written's errors for a directory holding files the tool did
    not write, or one that cannot take the checkpoint."""
    marker = directory / INFO
    record = written.read_record(marker, TOOL, _legacy_record)
    written.refuse_foreign(directory, marker, record, WHAT)
    if (record is not None and record["complete"]
            and (record.get("requested_bytes"), record.get("dtype"), record.get("ple_layers"))
            == (table_bytes, dtype, ple_layers)
            and all((directory / name).is_file() for name in record["files"])):
        return record
    written.refuse_no_room(directory, int(table_bytes), record, WHAT)
    return None


def drop_page_cache(directory: Path, pattern: str = "*.safetensors") -> None:
    """Evicts the pages of the files under ``directory`` that ``pattern``
    matches (the checkpoint's) from the page cache (clean pages only)."""
    for file in directory.rglob(pattern):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def proc_status(key: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def disk_read_bytes() -> int:
    """Bytes this process has had read from the block device (readahead too)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run_arm(spec: dict) -> dict:
    """One arm, in this process: load, then generate."""
    import transformers
    from transformers import Qwen4ExpForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    import torch

    directory, dtype = Path(spec["dir"]), getattr(torch, DTYPES[spec["dtype"]])
    before = proc_status("VmRSS")
    read_before = disk_read_bytes()
    start = time.perf_counter()
    offload_dir = None
    if spec["arm"] == "ple":
        from ple.integrations.transformers import from_pretrained

        model = from_pretrained(Qwen4ExpForCausalLM, directory, dtype=dtype)
    elif spec["arm"] == "in-memory":
        model = Qwen4ExpForCausalLM.from_pretrained(directory, dtype=dtype)
    else:
        offload_dir = tempfile.mkdtemp(prefix="offload-", dir=spec.get("offload_dir") or directory)
        tables = json.loads((directory / INFO).read_text())["tables"]
        device_map = disk_device_map(Qwen4ExpForCausalLM, directory, tables)
        model = Qwen4ExpForCausalLM.from_pretrained(directory, dtype=dtype, device_map=device_map,
                                                    offload_folder=offload_dir)
    load_s = time.perf_counter() - start
    load_peak = proc_status("VmHWM") - before
    generator = torch.Generator().manual_seed(spec["seed"])
    first_prompt, warmup, prompt = (
        torch.randint(3, model.config.vocab_size, (1, spec["prompt"]), generator=generator)
        for _ in range(3))
    new = spec["new_tokens"]
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(first_prompt, max_new_tokens=1, do_sample=False)
        first_s = time.perf_counter() - start
        first_gather_s = _gather_seconds(model) if spec["arm"] == "ple" else None
        # The first decode steps of a process cost more (code paths run for
        # the first time): a warm-up on other tokens, so other rows.
        model.generate(warmup, max_new_tokens=1 + new, min_new_tokens=1 + new, do_sample=False)
        runs = []
        for _ in range(2):  # new rows (cold for ple), then the same rows again
            streamer = TokenTimes()
            tokens = model.generate(prompt, max_new_tokens=1 + new, min_new_tokens=1 + new,
                                    do_sample=False, streamer=streamer)
            runs.append(streamer.intervals_ms())
    record = {"arm": spec["arm"], "load_s": load_s, "load_peak_bytes": load_peak,
              "peak_bytes": proc_status("VmHWM") - before, "first_token_s": first_s,
              "first_token_gather_s": first_gather_s,
              "disk_read_bytes": disk_read_bytes() - read_before,
              "ms_per_token": statistics.median(runs[0]), "ms_per_token_again":
              statistics.median(runs[1]), "token_ms": runs,
              "tokens": tokens[0, spec["prompt"]:].tolist()}
    if spec["arm"] == "ple":
        from ple.integrations.transformers import tables

        stats = [t.stats() for t in tables(model).values()]
        record["gathered_rows"] = sum(s["rows"] for s in stats)
        record["gather_s"] = sum(s["gather_ns"] for s in stats) / 1e9
        record["major_faults"] = sum(s["major_faults"] for s in stats)
        record["tables"] = len(stats)
    if offload_dir is not None:
        record["offload_folder_bytes"] = sum(f.stat().st_size for f in Path(offload_dir).rglob("*")
                                             if f.is_file())
        shutil.rmtree(offload_dir, ignore_errors=True)
    return record


def disk_device_map(model_class, directory: Path, disk: Iterable[str]) -> dict[str, str]:
    """A device_map with the modules ``disk`` on "disk" and everything else
    on "cpu", naming each module or tensor next to them: accelerate places a
    non-offloaded entry's whole subtree, so ``{"": "cpu", name: "disk"}``
    would fail on the offloaded weight."""
    import torch
    from transformers import AutoConfig

    with torch.device("meta"):
        model = model_class(AutoConfig.from_pretrained(directory))
    disk = set(disk)
    device_map = {}

    def walk(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            full = prefix + name
            if full in disk:
                device_map[full] = "disk"
            elif any(d.startswith(full + ".") for d in disk):
                walk(full + ".", child)
            else:
                device_map[full] = "cpu"
        for name, _ in chain(module.named_parameters(recurse=False),
                             module.named_buffers(recurse=False)):
            device_map[prefix + name] = "cpu"

    walk("", model)
    return device_map


def _gather_seconds(model) -> float:
    from ple.integrations.transformers import tables

    return sum(t.stats()["gather_ns"] for t in tables(model).values()) / 1e9


class TokenTimes:
    """A generate() streamer that notes when each token comes: the prompt
    first, then one token a step."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def intervals_ms(self) -> list[float]:
        """The decode steps' times: from the first new token to each next."""
        return [(b - a) * 1e3 for a, b in zip(self.times[1:], self.times[2:])]


def spawn_arm(spec: dict, timeout: float) -> dict:
    try:
        child = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                               capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"arm": spec["arm"], "skipped": f"ran past {timeout:.0f} s"}
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        tail = (child.stderr or child.stdout).strip().splitlines()[-3:]
        return {"arm": spec["arm"], "skipped": f"failed (exit {child.returncode}): "
                + " | ".join(tail)[-400:]}
    return json.loads(lines[-1])


def gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def has_qwen4exp() -> bool:
    """Whether this Python's transformers has Qwen4Exp (finding it imports
    transformers' package, not its models)."""
    try:
        return importlib.util.find_spec("transformers.models.qwen4_exp") is not None
    except ModuleNotFoundError:  # no transformers
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("data/bench_transformers"),
                        help="the checkpoint's directory: reused if this tool wrote one of this "
                        "size there, else written there; a directory holding files it did not "
                        "write is refused (default data/bench_transformers)")
    parser.add_argument("--table-gib", type=positive_float, default=3.0,
                        help="GiB of n-gram tables in all (default 3)")
    parser.add_argument("--ple-layers", type=int_range(1, MOST_PLE_LAYERS, " (the model's "
                        "linear-attention layers)"), default=2, help="PLE layers (default 2)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16",
                        help="of the stored rows and of the loaded model (default bf16)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma separated, of {ARMS}")
    parser.add_argument("--in-memory", dest="in_memory", action="store_true",
                        help="run the in-memory arm even when MemAvailable looks too small")
    parser.add_argument("--prompt", type=positive_int, default=32,
                        help="prompt tokens (default 32)")
    parser.add_argument("--new-tokens", type=positive_int, default=32,
                        help="timed tokens (default 32)")
    parser.add_argument("--seed", type=seed, default=0, help="of the prompts (default 0)")
    parser.add_argument("--timeout", type=seconds, default=1200, help="seconds per arm")
    parser.add_argument("--offload-dir", action=OutputDirectory,
                        help="where disk-offload writes (default --dir)")
    add_json_option(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [arm for arm in args.arms.split(",") if arm not in ARMS]
    if unknown:
        parser.error(f"argument --arms: unknown {unknown}; arms: {', '.join(ARMS)}")
    # generate's tokens: the prompt, then one and --new-tokens more (TokenTimes).
    context = MODEL_CONFIG["max_position_embeddings"]
    if args.prompt + 1 + args.new_tokens > context:
        parser.error(f"argument --prompt: {args.prompt:,} tokens, then {1 + args.new_tokens:,} "
                     f"generated, are more than the model's {context:,} positions")
    if not args.child:
        try:
            existing_checkpoint(args.dir, args.table_gib * 2**30, DTYPES[args.dtype],
                                args.ple_layers)
        except written.DirectoryError as error:
            written.refuse_on_command_line(parser, error, "--dir", "--table-gib")
        if not has_qwen4exp():
            print(f"error: ple-bench-transformers runs transformers' Qwen4Exp, which "
                  f"{sys.executable} does not have: install a transformers that has it "
                  "(pip install --no-build-isolation '.[transformers]')", file=sys.stderr)
            return 2
    if args.child:
        print(json.dumps(run_arm(json.loads(args.child))))
        return 0
    return run_recorded(args, "bench_transformers", argv, lambda: run(args))


def run(args: argparse.Namespace) -> tuple[int, dict]:
    import torch

    dtype = getattr(torch, DTYPES[args.dtype])
    start = time.perf_counter()
    info = ensure_checkpoint(args.dir, args.table_gib * 2**30, dtype, ple_layers=args.ple_layers)
    print(f"checkpoint {args.dir}: {len(info['tables'])} n-gram tables, {gib(info['table_bytes'])} "
          f"GiB of {info['dtype']} rows (ready in {time.perf_counter() - start:.1f} s)")
    print(f"machine: {os.cpu_count()} CPUs, {gib(mem_available())} GiB available, torch "
          f"{torch.__version__}, load average {os.getloadavg()[0]:.2f}")
    results = []
    for arm in args.arms.split(","):
        if arm == "in-memory" and not args.in_memory and mem_available() < 2.5 * info["table_bytes"]:
            results.append({"arm": arm, "skipped": "too little memory (--in-memory runs it)"})
            continue
        drop_page_cache(args.dir)
        # The child's offload folder goes in one of this process's, removed
        # even when the child is killed: a folder left in --dir would make
        # the next run refuse the checkpoint (ple_tools.written).
        offload_dir = (tempfile.mkdtemp(prefix="offload-", dir=args.offload_dir or args.dir)
                       if arm == "disk-offload" else None)
        spec = {"arm": arm, "dir": str(args.dir), "dtype": args.dtype, "prompt": args.prompt,
                "new_tokens": args.new_tokens, "seed": args.seed, "offload_dir": offload_dir}
        try:
            results.append(spawn_arm(spec, args.timeout) | {"loadavg": os.getloadavg()[0]})
        finally:
            if offload_dir is not None:
                shutil.rmtree(offload_dir, ignore_errors=True)
        print(f"  {arm}: done (load average {os.getloadavg()[0]:.2f})", flush=True)

    print(f"\n{'arm':<14}{'load s':>9}{'peak RSS GiB':>14}{'first token s':>15}{'ms/token':>10}"
          f"{'again':>8}{'disk read GiB':>15}")
    reference = next((r["tokens"] for r in results if "tokens" in r), None)
    for r in results:
        if "skipped" in r:
            print(f"{r['arm']:<14}  skipped: {r['skipped']}")
            continue
        same = "" if r["tokens"] == reference else "  (tokens differ!)"
        print(f"{r['arm']:<14}{r['load_s']:>9.2f}{gib(r['peak_bytes']):>14}"
              f"{r['first_token_s']:>15.3f}{r['ms_per_token']:>10.1f}"
              f"{r['ms_per_token_again']:>8.1f}{gib(r['disk_read_bytes']):>15}{same}")
    ok = all(r.get("tokens", reference) == reference for r in results)
    return (0 if ok else 1), {"checkpoint": info, "results": results}


if __name__ == "__main__":
    sys.exit(main())
