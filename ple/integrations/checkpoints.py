"""A checkpoint's safetensors files: those a local folder's index (or single
file) names, and the folder of a hub repo's snapshot in huggingface_hub's
cache.  Both integrations find the files they serve tables from here."""

from __future__ import annotations

import json
from pathlib import Path

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def safetensors_files(directory: str | Path, variant: str | None = None) -> list[Path]:
    """The safetensors files of the checkpoint in ``directory``: those that
    ``model.safetensors.index.json`` names, else ``model.safetensors``
    (``model.<variant>.safetensors...`` with a variant)."""
    directory = Path(directory)
    index = directory / _with_variant(SAFE_WEIGHTS_INDEX_NAME, variant)
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / _with_variant(SAFE_WEIGHTS_NAME, variant)
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{directory}: neither {index.name} nor {single.name}: ple serves "
                            "tables from safetensors checkpoints")


def _with_variant(name: str, variant: str | None) -> str:
    if variant is None:
        return name
    stem, ext = name.split(".", 1)
    return f"{stem}.{variant}.{ext}"


def local_snapshot(repo_id: str, *, subfolder: str = "", revision: str | None = None,
                   cache_dir: str | Path | None = None, token=None,
                   force_download: bool = False, offline: bool = True) -> Path:
    """The folder of the snapshot of hub repo ``repo_id`` in huggingface_hub's
    cache (its files are links into the cache's blobs, which ple maps as any
    file).  ``offline``: take what the cache holds, else download the
    snapshot's ``*.json`` and ``*.safetensors`` files (of ``subfolder``)
    first.  A FileNotFoundError when ``repo_id`` is no repo id, or when the
    cache has no such snapshot offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(str(repo_id))
    except HFValidationError:
        raise FileNotFoundError(f"{repo_id}: not a local checkpoint directory, nor a hub repo id "
                                "(ple maps the checkpoint's own files, so it serves checkpoints "
                                "on disk only)") from None
    patterns = [f"{subfolder}/*{ext}" if subfolder else f"*{ext}" for ext in (".json", ".safetensors")]
    try:
        return Path(snapshot_download(str(repo_id), revision=revision, cache_dir=cache_dir,
                                      token=token, force_download=force_download,
                                      local_files_only=offline, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{repo_id}: not a local directory, and huggingface_hub's cache "
            f"({cache_dir or constants.HF_HUB_CACHE}) has no snapshot of it at revision "
            f"{revision or 'main'!r}: download it first (hf download {repo_id})") from None
