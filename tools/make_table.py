"""Writes a table of random FP8 E4M3FN rows as sharded safetensors files, the
layout of the reference n-gram checkpoint: ``<prefix>.shard_{i}.weight`` and a
``<prefix>.weight_scale`` scalar.

    python tools/make_table.py data/table --mib 256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

PREFIX = "ngram_embedding"
SCALE = 0.0078125


def random_fp8_rows(rows: int, row_bytes: int, generator: torch.Generator) -> torch.Tensor:
    """Random FP8 rows without NaN patterns (0x7f, 0xff), as real weights are."""
    raw = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=generator)
    raw[(raw & 0x7F) == 0x7F] ^= 1
    return raw.view(torch.float8_e4m3fn)


def write_table(directory: Path, *, rows: int, row_bytes: int = 160, shards: int = 8,
                files: int = 4, seed: int = 0) -> list[Path]:
    """Writes `rows` rows in `shards` equal shards (the last one shorter) spread
    over `files` files, prints progress, and fsyncs so the pages are clean (a
    cold benchmark can then drop them).  Returns the files."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    per_shard = -(-rows // shards)
    shard_ids = [i for i in range(shards) if i * per_shard < rows]
    paths = []
    for f in range(files):
        tensors = {}
        for i in shard_ids[f::files]:
            count = min(per_shard, rows - i * per_shard)
            tensors[f"{PREFIX}.shard_{i}.weight"] = random_fp8_rows(count, row_bytes, generator)
        if f == 0:
            tensors[f"{PREFIX}.weight_scale"] = torch.tensor(SCALE, dtype=torch.float32)
        if not tensors:
            continue
        path = directory / f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        save_file(tensors, str(path))
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
        paths.append(path)
        done = sum(t.numel() for t in tensors.values())
        print(f"  wrote {path.name} ({done / 2**20:.0f} MiB) [{f + 1}/{files}]", file=sys.stderr)
    return paths


LAYOUT_FILE = "layout.json"


def ensure_table(directory: Path, *, rows: int, row_bytes: int = 160, shards: int = 8,
                 files: int = 4, seed: int = 0) -> None:
    """Writes the table unless `directory` holds one written with these very
    arguments (its layout file, written last, says so: a table cut short by
    an interrupted write is written again)."""
    layout = {"rows": rows, "row_bytes": row_bytes, "shards": shards, "files": files, "seed": seed}
    marker = directory / LAYOUT_FILE
    try:
        if json.loads(marker.read_text()) == layout:
            return
    except (OSError, ValueError):
        pass
    marker.unlink(missing_ok=True)
    for old in directory.glob("*.safetensors"):
        old.unlink()
    print(f"writing a table of {rows:,} rows of {row_bytes} B "
          f"({rows * row_bytes / 2**20:.0f} MiB) in {directory}", file=sys.stderr)
    write_table(directory, **layout)
    marker.write_text(json.dumps(layout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--mib", type=float, default=256, help="table size (default 256)")
    parser.add_argument("--row-bytes", type=int, default=160)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = int(args.mib * 2**20) // args.row_bytes
    ensure_table(args.directory, rows=rows, row_bytes=args.row_bytes, shards=args.shards,
                 files=args.files, seed=args.seed)


if __name__ == "__main__":
    main()
