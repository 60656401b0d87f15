"""What ple knows of each model family whose tables it serves: which module
``offload="auto"`` serves, and which ids that module gathers for a prompt's
tokens (what lookahead reads ahead).  One entry per family in
:data:`FAMILIES`; adding a family is one entry here, one file under
``vllm/`` and its tests.

- Per-layer inputs (Gemma 3n, Gemma 4): ``embed_tokens_per_layer``, an
  ``nn.Embedding`` of ``[per-layer vocabulary, layers x per-layer hidden]``
  looked up with the token ids, those outside the table as 0 (transformers'
  Gemma 4 would fail on them; vLLM's takes them as 0), and Gemma 4's image,
  video and audio placeholders as the pad token (0).
- Hashed n-grams (Qwen4Exp): each PLE layer's ``ngram_embedding``, looked up
  with the n-gram ids its owner hashes from the tokens and the ``ngram_size
  - 1`` before them (``ple.layers.NGramHashing`` with the owner's own
  constants); a token the attention mask masks counts as EOS, in a chunk
  of more than one token, as the model's linear-attention mask makes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FAMILIES", "Family", "auto_module_names", "family_of_module", "table_names"]


@dataclass(frozen=True)
class Family:
    """A model family: ``name`` for messages, the transformers ``model_types``
    of its configs, and ``table``, the last name of the module (and of its
    checkpoint tensor, before ``.weight`` or ``.shard_{i}.weight``) that
    ``offload="auto"`` serves."""

    name: str
    model_types: tuple[str, ...]
    table: str

    def served_names(self, name: str, module: nn.Module) -> list[str]:
        """The names of the tables ``offload="auto"`` serves that are
        ``module`` (named ``name`` in its model) or its children."""
        raise NotImplementedError

    def owns(self, owner: nn.Module, module: nn.Module) -> bool:
        """Whether ``module`` is the served table of its parent ``owner`` in this family."""
        raise NotImplementedError

    def prompt_ids(self, model: nn.Module, owner: nn.Module, module: nn.Module,
                   prompt: torch.Tensor, attended: torch.Tensor | None
                   ) -> tuple[torch.Tensor, int]:
        """The ids ``module`` (a child of ``owner`` in ``model``) is given for
        a prompt ``[batch, length]`` of token ids (CPU int64; ``attended``:
        which tokens the model's mask keeps, or None for all), and the
        dimension of their length."""
        raise NotImplementedError


@dataclass(frozen=True)
class PerLayerInputs(Family):
    """Gemma's per-layer inputs: the token ids, those outside the table as 0
    (``clamp_outside``), multimodal placeholders as the pad token
    (``placeholders``: the config keys of their token ids)."""

    clamp_outside: bool = False
    placeholders: tuple[str, ...] = ()

    def served_names(self, name: str, module: nn.Module) -> list[str]:
        return [name] if name.rsplit(".", 1)[-1] == self.table and _is_embedding(module) else []

    def owns(self, owner: nn.Module, module: nn.Module) -> bool:
        return getattr(owner, self.table, None) is module

    def prompt_ids(self, model, owner, module, prompt, attended):
        return self.token_ids(model.config, module, prompt), -1

    def token_ids(self, config, module: nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
        """The ids the table is looked up with for ``token_ids`` in a model
        of ``config`` (the multimodal config's placeholders, where it has them)."""
        if self.placeholders:
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            pad = getattr(text, "pad_token_id", None)
            ids = [getattr(config, key, None) for key in self.placeholders]
            ids = [i for i in ids if isinstance(i, int)]
            if ids and isinstance(pad, int):
                token_ids = torch.where(torch.isin(token_ids, torch.tensor(ids)), pad, token_ids)
        if self.clamp_outside:
            in_table = (token_ids >= 0) & (token_ids < module.num_embeddings)
            token_ids = torch.where(in_table, token_ids, 0)
        return token_ids


@dataclass(frozen=True)
class HashedNGrams(Family):
    """Qwen4Exp's n-gram tables, hashed by their owner
    (``Qwen4ExpTextNGramEmbedding``)."""

    owner_suffix: str = "NGramEmbedding"

    def served_names(self, name: str, module: nn.Module) -> list[str]:
        table = getattr(module, self.table, None)
        if type(module).__name__.endswith(self.owner_suffix) and _is_embedding(table):
            return [f"{name}.{self.table}" if name else self.table]
        return []

    def owns(self, owner: nn.Module, module: nn.Module) -> bool:
        return (type(owner).__name__.endswith(self.owner_suffix)
                and getattr(owner, self.table, None) is module)

    def prompt_ids(self, model, owner, module, prompt, attended):
        batch, length = prompt.shape
        if attended is not None:
            prompt = torch.where(attended, prompt, owner.eos_token_id)
        seq_ids = torch.arange(batch).repeat_interleave(length)
        ids = self.hashing(owner).row_ids(prompt.reshape(-1), seq_ids)
        return ids.view(batch, length, -1), 1

    @staticmethod
    def hashing(owner: nn.Module):
        """The hashing of a transformers ``Qwen4ExpTextNGramEmbedding``, with its own constants."""
        from ple.layers.ngram_ids import NGramConstants, NGramHashing

        constants = NGramConstants(
            layer_multipliers=owner.layer_multipliers.tolist(),
            head_vocab_sizes=owner.ngram_heads_vocab_sizes.tolist(),
            head_offsets=owner.ngram_heads_offsets.tolist())
        return NGramHashing(vocab_size=owner.unigram_vocab_size, eos_id=owner.eos_token_id,
                            base_size=owner.ngram_vocab_size_base, ngram_size=owner.ngram_size,
                            heads_per_ngram=owner.heads_per_ngram, seed=owner.seed,
                            ple_layer_index=owner.ple_layer_index, constants=constants)


GEMMA3N = PerLayerInputs("Gemma 3n", ("gemma3n", "gemma3n_text"), "embed_tokens_per_layer",
                         clamp_outside=True)
GEMMA4 = PerLayerInputs("Gemma 4", ("gemma4", "gemma4_text"), "embed_tokens_per_layer",
                        clamp_outside=True,
                        placeholders=("image_token_id", "video_token_id", "audio_token_id"))
QWEN4EXP = HashedNGrams("Qwen4Exp", ("qwen4_exp", "qwen4_exp_text"), "ngram_embedding")

# By transformers' model_type, as Liger-Kernel keys its patches.
FAMILIES: dict[str, Family] = {model_type: family for family in (GEMMA3N, GEMMA4, QWEN4EXP)
                               for model_type in family.model_types}
# The families whose tables "auto" finds by the modules' names and types
# (Gemma 4's table has Gemma 3n's name), in any model.
_BY_NAME = (QWEN4EXP, GEMMA3N)


def table_names() -> tuple[str, ...]:
    """The last names of the tables ``offload="auto"`` serves."""
    return tuple(dict.fromkeys(family.table for family in FAMILIES.values()))


def auto_module_names(model: nn.Module) -> list[str]:
    """The modules ``offload="auto"`` serves in ``model``: the
    ``ngram_embedding`` of every n-gram owner, and every embedding named
    ``embed_tokens_per_layer``."""
    return [served for name, module in model.named_modules()
            for family in _BY_NAME for served in family.served_names(name, module)]


def family_of_module(model: nn.Module, owner: nn.Module, module: nn.Module) -> Family:
    """The family whose table ``module`` (a child of ``owner``) is: by the
    model's ``model_type`` where the family is known, else by the module's
    place (a token table, as Gemma 3n's, for any other embedding)."""
    config = getattr(model, "config", None)
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is not None and family.owns(owner, module):
        return family
    return QWEN4EXP if QWEN4EXP.owns(owner, module) else GEMMA3N


def _is_embedding(module: nn.Module) -> bool:
    from ple.layers.disk_embedding import DiskEmbedding

    return isinstance(module, (nn.Embedding, DiskEmbedding))
