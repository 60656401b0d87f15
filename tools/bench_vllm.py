"""A Gemma 3n served through ``vllm.LLM`` whose ``embed_tokens_per_layer`` is
a GiB or more: memory after load, load time, time to first token and
per-token time, with the table in memory and served by ple (the vLLM plugin,
ple.integrations.vllm), cold and warm.

    python tools/bench_vllm.py [--dir data/bench_vllm] [--table-gib 1] [--json PATH]

Needs vLLM (``make test-vllm`` builds .venv-vllm: run the tool with its
python).  The checkpoint is a tiny random Gemma 3n text model (hidden size
64, 4 layers) whose per-layer table has ``--table-gib`` GiB of bfloat16 rows
(262,144 rows, as Gemma 3n E4B), in a file of its own beside the other
weights, as the published checkpoints are sharded; a directory that already
holds one of that size is reused, one that holds files the tool did not
write is refused (its ple_bench.json lists the files it wrote, the only ones
it deletes).  Each arm is a process of its own with vLLM's engine in it
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager (``enforce_eager``), after the
checkpoint's pages were dropped from the page cache:

- ``in-memory``: ``PLE_OFFLOAD=none``: ple's class with vLLM's embedding,
  the table loaded into memory;
- ``ple``: ``PLE_OFFLOAD=auto``: the table stays in its file.

``load s`` is the ``vllm.LLM(...)`` call, ``RSS after load`` the process's
resident memory after it less before it (a KV cache of 1 GiB in both arms,
``VLLM_CPU_KVCACHE_SPACE=1``; prefix caching off), ``first token s`` a greedy generate of one token
after ``--prompt`` tokens, ``ms/token`` the median decode step of a generate
of ``--new-tokens`` tokens after it; ``cold`` is the first prompt (its rows
never read), ``warm`` the same prompt again.  Both arms must generate the
same tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ple_tools import written
from ple_tools.arm_child import module_command
from ple_tools.argtypes import positive_float, positive_int, refuse_over_memory
from ple_tools.figures import add_json_option, run_recorded

ARMS = {"in-memory": "none", "ple": "auto"}
INFO = "ple_bench.json"
TOOL = "ple-bench-vllm"
WHAT = "a checkpoint"
TABLE = "model.embed_tokens_per_layer.weight"
OTHERS_FILE = "model-00001-of-00002.safetensors"
TABLE_FILE = "model-00002-of-00002.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ROWS = 262_144
LAYERS = 4
MODEL_CONFIG = dict(
    vocab_size=ROWS, vocab_size_per_layer_input=ROWS, hidden_size=64, intermediate_size=128,
    num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    num_kv_shared_layers=2, laurel_rank=8, sliding_window=16,
    layer_types=["sliding_attention", "full_attention"] * 2,
    activation_sparsity_pattern=[0.0] * LAYERS, altup_num_inputs=2,
    max_position_embeddings=1024, tie_word_embeddings=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("data/bench_vllm"),
                        help="where the checkpoint is written, or reused (default data/bench_vllm)")
    parser.add_argument("--table-gib", type=positive_float, default=1.0,
                        help="the per-layer table's size in GiB (default 1; at least 1/64)")
    parser.add_argument("--prompt", type=positive_int, default=256,
                        help="prompt tokens (default 256)")
    parser.add_argument("--new-tokens", type=positive_int, default=32,
                        help="tokens generated for the per-token time (default 32)")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"comma-separated arms among {', '.join(ARMS)} (default all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args(argv)
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}; expected among {list(ARMS)}")
    if args.table_gib < 1 / 64:
        parser.error("--table-gib must be at least 1/64")
    # vLLM's max_model_len (run_arm's), within the model's positions.
    context = MODEL_CONFIG["max_position_embeddings"]
    if args.prompt + args.new_tokens + 8 > context:
        parser.error(f"argument --prompt: {args.prompt:,} tokens and {args.new_tokens:,} new ones "
                     f"(and 8 of room) are more than the model's {context:,} positions")
    table_bytes = ROWS * LAYERS * per_layer_width(args.table_gib) * 2
    # The model is made in float32, cast to bfloat16, saved, and read back.
    refuse_over_memory(parser, "--table-gib", 5 * table_bytes,
                       "writing the checkpoint (its table in float32, in bfloat16, and read back)")
    if not args.child:
        marker = args.dir / INFO
        record = written.read_record(marker, TOOL)
        try:
            written.refuse_foreign(args.dir, marker, record, WHAT)
            if not reusable(record, args.table_gib):
                written.refuse_no_room(args.dir, table_bytes, record, WHAT)
        except written.DirectoryError as error:
            written.refuse_on_command_line(parser, error, "--dir", "--table-gib")
    return args


def reusable(record: dict | None, table_gib: float) -> bool:
    """Whether ``record`` is that of a checkpoint of this size, written to the end."""
    return (record is not None and record["complete"]
            and record.get("width") == per_layer_width(table_gib))


def per_layer_width(table_gib: float) -> int:
    """hidden_size_per_layer_input for a bfloat16 table of about table_gib."""
    return max(1, round(table_gib * 2**30 / (ROWS * LAYERS * 2)))


def write_checkpoint(directory: Path, table_gib: float) -> dict:
    """The checkpoint (reused when the directory holds one of that size)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    width = per_layer_width(table_gib)
    marker = directory / INFO
    record = written.read_record(marker, TOOL)
    if reusable(record, table_gib):
        return record
    written.refuse_foreign(directory, marker, record, WHAT)
    names = ["config.json", "generation_config.json", OTHERS_FILE, TABLE_FILE, INDEX_FILE]
    written.begin(directory, marker, TOOL, record, names, what=WHAT, width=width)
    torch.manual_seed(0)
    small = Gemma3nForCausalLM(Gemma3nTextConfig(**MODEL_CONFIG,
                                                 hidden_size_per_layer_input=width)).eval()
    for layer in small.model.layers:  # else the logits would not depend on the table
        torch.nn.init.normal_(layer.altup.correct_output_scale)
    small.to(torch.bfloat16).save_pretrained(directory)
    single = directory / "model.safetensors"
    with safe_open(single, "pt") as f:
        weights = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    single.unlink()
    save_file({TABLE: weights.pop(TABLE)}, str(directory / TABLE_FILE), metadata={"format": "pt"})
    save_file(weights, str(directory / OTHERS_FILE), metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(weights, OTHERS_FILE), TABLE: TABLE_FILE}
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in (OTHERS_FILE, TABLE_FILE):
        fd = os.open(directory / name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    written.finish(marker, TOOL, names, what=WHAT, width=width)
    return written.read_record(marker, TOOL)


def drop_pages(directory: Path) -> None:
    for name in (OTHERS_FILE, TABLE_FILE):
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def run_arm(args: argparse.Namespace) -> dict:
    """One arm, in this process (the tool's child)."""
    from vllm import LLM, SamplingParams

    drop_pages(args.dir)
    before = rss_bytes()
    start = time.perf_counter()
    llm = LLM(model=str(args.dir), skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              enforce_eager=True, max_model_len=args.prompt + args.new_tokens + 8,
              max_num_seqs=1, enable_prefix_caching=False)
    load_s = time.perf_counter() - start
    loaded = rss_bytes() - before
    result = {"arm": args.child, "load_s": load_s, "rss_after_load_bytes": loaded}
    prompt = [(i * 7919 + 13) % ROWS for i in range(args.prompt)]
    for phase in ("cold", "warm"):
        first = _generate(llm, prompt, 1)
        tokens, step_times = _timed_steps(llm, prompt, args.new_tokens)
        result[phase] = {"first_token_s": first, "ms_per_token": statistics.median(step_times),
                         "tokens": tokens}
    return result


def _generate(llm, prompt: list[int], n: int) -> float:
    from vllm import SamplingParams

    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=n, temperature=0,
                                                                 detokenize=False),
                 use_tqdm=False)
    return time.perf_counter() - start


def _timed_steps(llm, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """The tokens of a greedy generate of n tokens and each decode step's ms
    (streamed through the engine one step at a time)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    engine.add_request("timed", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=n, temperature=0, detokenize=False))
    times, tokens, last = [], [], None
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = (time.perf_counter() - start) * 1e3
        for output in outputs:
            tokens = list(output.outputs[0].token_ids)
        if last is not None:  # the first step is the prefill
            times.append(elapsed)
        last = elapsed
    return tokens, times


def run(args: argparse.Namespace) -> tuple[int, dict]:
    start = time.perf_counter()
    record = write_checkpoint(args.dir, args.table_gib)
    table_bytes = (args.dir / TABLE_FILE).stat().st_size
    print(f"checkpoint {args.dir}: embed_tokens_per_layer {ROWS} x "
          f"{LAYERS * record['width']} bfloat16, {table_bytes / 2**30:.2f} GiB "
          f"(ready in {time.perf_counter() - start:.1f} s)")
    results = []
    for arm in args.arms.split(","):
        # A KV cache of 1 GiB in both arms: vLLM's CPU worker would size it
        # from the memory the model leaves, so the arms' RSS would differ by it.
        env = {**os.environ, "PLE_OFFLOAD": ARMS[arm], "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_KVCACHE_SPACE": "1"}
        command = module_command("ple_tools.bench_vllm", "--dir", str(args.dir),
                                 "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
                                 "--child", arm)
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
        if done.returncode != 0:
            print(f"  {arm}: failed\n{done.stderr[-3000:]}")
            return 1, results
        line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
        results.append(json.loads(line.removeprefix("RESULT ")))
        print(f"  {arm}: done")
    print(f"\n{'arm':<10} {'load s':>7} {'RSS after load GiB':>19} {'first token s':>14} "
          f"{'ms/token':>9} {'warm first s':>13} {'warm ms/token':>14}")
    for r in results:
        print(f"{r['arm']:<10} {r['load_s']:>7.2f} {r['rss_after_load_bytes'] / 2**30:>19.2f} "
              f"{r['cold']['first_token_s']:>14.3f} {r['cold']['ms_per_token']:>9.2f} "
              f"{r['warm']['first_token_s']:>13.3f} {r['warm']['ms_per_token']:>14.2f}")
    same = len({json.dumps([r["cold"]["tokens"], r["warm"]["tokens"]]) for r in results}) == 1
    print(f"\n{'every arm generated the same tokens' if same else 'THE ARMS GENERATED OTHER TOKENS'}")
    return (0 if same else 1), results


def main(argv=None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        print(f"error: ple-bench-vllm runs vLLM, which {sys.executable} does not have: install "
              "it with `pip install --no-build-isolation '.[vllm]'` from a checkout of ple, or on "
              "a CPU machine run the tool with .venv-vllm's python, which `make test-vllm` builds "
              "(docs/vllm.md)", file=sys.stderr)
        return 2
    if args.child:
        print("RESULT " + json.dumps(run_arm(args)), flush=True)
        return 0
    return run_recorded(args, "bench_vllm", argv, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
