"""Which checkpoint tensors hold a module's weight, as transformers' loader
sees them: the keys it would rename to ``<name>.weight`` with the model's
weight conversions (a Qwen4Exp shard family, base-model prefixes, a
multimodal checkpoint's ``language_model``), and the keys it must neither
read nor warn about once ple serves them."""

from __future__ import annotations

import re
from pathlib import Path

from torch import nn

from ple.layers.disk_embedding import DiskEmbedding
from ple.safetensors_header import TensorEntry
from ple.safetensors_tables import (PUBLISHED_PREFIX, SHARD_NAME, TEXT_PREFIX, closest_names,
                                   describe_files, layout_names, scale_name)

from ..families import table_names


def _family(key: str) -> str | None:
    """The shard family prefix of ``<prefix>.shard_{i}.weight``, else None."""
    match = SHARD_NAME.match(key)
    return match["prefix"] if match else None


class CheckpointKeys:
    """Which checkpoint tensors hold a module's weight: the keys that
    transformers' loader would rename to ``<name>.weight`` (with the model's
    weight conversions: a Qwen4Exp shard family, base-model prefixes), or,
    for a model that is not a transformers model, ``<name>.weight`` and
    ``<name>.shard_{i}.weight`` as they are."""

    def __init__(self, model: nn.Module, entries: dict[str, TensorEntry], files: list[Path],
                 key_mapping):
        self.model = model
        self.entries = entries
        self.files = files
        self.prefix = getattr(model, "base_model_prefix", "") or ""
        self.key_mapping = key_mapping
        # The model's keys before any module is swapped.
        self.state = set(model.state_dict())
        # {checkpoint key: the model key transformers loads it into}.
        self.renamed = self._rename_all()

    def _rename_all(self) -> dict[str, str]:
        try:
            from transformers import PreTrainedModel
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                         rename_source_key)
        except ImportError:
            return {key: key for key in self.entries}
        if not isinstance(self.model, PreTrainedModel):
            return {key: key for key in self.entries}
        mapping = get_model_conversion_mapping(self.model, self.key_mapping)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        state = dict.fromkeys(self.state, True)
        renamed = {}
        for key in self.entries:
            new, _ = rename_source_key(key, renamings, converters, self.prefix, state)
            if new not in state and key in state:  # as the loader does
                new, _ = rename_source_key(key, [], [], self.prefix, state)
            renamed[key] = new
        return renamed

    def table_of(self, name: str) -> tuple[str, list[Path], set[str]]:
        """The tensor or shard family of module ``name``, the files to open
        it from, and the model keys the loader will report unexpected."""
        target = f"{name}.weight"
        keys = sorted(key for key, new in self.renamed.items() if new == target)
        if not keys:
            # Not a transformers model, or no conversion: the names as they are.
            keys = sorted(key for key in self.entries
                          if key == target or _family(key) == name)
        if not keys:
            raise ValueError(
                f"no table for {name!r} in {describe_files(self.files)}: looked for a tensor "
                f"{target!r} or a shard family '{name}.shard_{{i}}.weight' (after transformers' "
                f"key renaming, so also with or without the prefix {self.prefix!r}); the closest "
                f"of their {len(self.entries)} tensors: {closest_names(self.entries, target)}"
                f"{self._other_layout_hint(target)}")
        prefixes = {_family(key) for key in keys}
        if len(keys) == 1 and None in prefixes:
            tensor = keys[0]
            scale = scale_name(tensor)
        elif None not in prefixes and len(prefixes) == 1:
            tensor = prefixes.pop()
            scale = scale_name(tensor, family=True)
        else:
            raise ValueError(f"{name!r}: several checkpoint tensors load into {target!r} ({keys}), "
                             "neither one tensor nor one shard family")
        holding = [*keys, scale] if scale in self.entries else keys
        paths = list(dict.fromkeys(self.entries[key].path for key in holding))
        reported = {target, *(self.renamed.get(key, key) for key in holding)}
        return tensor, paths, reported

    def _other_layout_hint(self, target: str) -> str:
        """What to do when the checkpoint holds ``target`` in the other layout
        (``model.language_model.x`` for ``model.x``, or the other way round),
        which transformers does not rename for this class."""
        other = next((name for name in layout_names(target)[1:] if name in self.entries), None)
        if other is None:
            return ""
        old, new = (PUBLISHED_PREFIX, TEXT_PREFIX) if other.startswith(PUBLISHED_PREFIX) else (
            TEXT_PREFIX, PUBLISHED_PREFIX)
        return (f". The checkpoint holds it as {other!r}, a layout that transformers does not "
                f"rename for {type(self.model).__name__} (it would load none of the text "
                f"model's weights either): pass key_mapping={{'^{old}': '{new}'}}, or load it with "
                "the checkpoint's own class (AutoModelForCausalLM resolves it)")

    def ignore_unexpected(self, keys: set[str]) -> None:
        """Adds the keys to the model's ``_keys_to_ignore_on_load_unexpected``
        (regexes searched in the reported keys), with or without the
        base-model prefix, so that transformers does not warn about them."""
        patterns = set()
        for key in keys:
            rest = key.removeprefix(f"{self.prefix}.") if self.prefix else key
            prefix = rf"(?:{re.escape(self.prefix)}\.)?" if self.prefix else ""
            patterns.add(rf"^{prefix}{re.escape(rest)}$")
        ignored = getattr(self.model, "_keys_to_ignore_on_load_unexpected", None) or set()
        self.model._keys_to_ignore_on_load_unexpected = (
            ignored | patterns if isinstance(ignored, set) else [*ignored, *sorted(patterns)])

    def refuse_tables_left(self, swapped: dict[str, tuple[DiskEmbedding, str]]) -> None:
        """A ValueError for the checkpoint's tables of offload="auto"'s kind
        (``families.table_names()``) that transformers would load into the model (which
        has a parameter for them) but that no module of ``swapped`` serves:
        loaded, they would be read whole into memory."""
        served = {f"{name}.weight" for name in swapped}
        left: dict[str, str] = {}
        for key, target in self.renamed.items():
            table = _family(key) or key.removesuffix(".weight")
            if (table.rsplit(".", 1)[-1] in table_names() and target in self.state
                    and target not in served):
                left.setdefault(table, target)
        if left:
            table, target = next(iter(left.items()))
            more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
            raise ValueError(
                f"ple: offload='auto' would leave the table {table!r}{more} of "
                f"{describe_files(self.files)} to be read into memory as {target!r}: no module "
                f"of {type(self.model).__name__} there is one that 'auto' serves (a Qwen4Exp "
                "n-gram module's ngram_embedding, an nn.Embedding named "
                "embed_tokens_per_layer); name the module in offload=[...] to serve it, or pass "
                "offload=[] to load it into memory")
