"""Lookahead for transformers' chunked prefill.

``generate(..., prefill_chunk_size=N)`` prefills a prompt ``[batch, length]``
in chunks, ``input_ids.split(N, dim=-1)``, one forward each.  Before
transformers' own ``generate`` runs, :func:`start` hands every offloaded
module (``DiskEmbedding``) the row ids its forwards will gather, chunk by
chunk (``DiskEmbedding.lookahead``), so that each chunk's rows are read
while the chunk before computes; :func:`end` drops what was read ahead and
not gathered, when ``generate`` returns or raises.  The ids are those the
modules' owners compute:

- an n-gram table (``Qwen4ExpTextNGramEmbedding.ngram_embedding``): the
  owner's hashed n-gram ids ``[batch, length, heads]``, by
  ``ple.layers.NGramHashing`` with the owner's own constants (its buffers),
  a new request's history being all EOS as in the owner's first forward.
  The tokens hashed are those Qwen4Exp's text model hands its PLE layers: in
  a chunk of more than one token, those that the attention mask masks
  (padding) are EOS (its linear-attention mask); transformers makes no such
  mask for a chunk of one token, whose token is hashed as it is;
- any other table (Gemma 3n's ``embed_tokens_per_layer``, a token
  embedding): the token ids, padding included, those outside the table
  taken as 0 as Gemma 3n does for its per-layer inputs.

The attention mask is the one ``generate`` is given (``attention_mask=``);
without one, every token counts as attended.  A forward whose ids differ
from the plan reads its own rows and ends the plan, as does a forward of
another size (the bytes are right either way; ``ple.layers.lookahead``).
"""

from __future__ import annotations

import torch
from torch import nn

from ple.layers.disk_embedding import DiskEmbedding
from ple.layers.lookahead import Lookahead
from ple.layers.ngram_ids import NGramConstants, NGramHashing

__all__ = ["end", "gathered_token_ids", "prefill_chunk_size", "start"]


def prefill_chunk_size(model: nn.Module, kwargs: dict) -> int | None:
    """The chunk size a ``generate(**kwargs)`` of ``model`` prefills with."""
    if kwargs.get("prefill_chunk_size") is not None:
        return kwargs["prefill_chunk_size"]
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return getattr(config, "prefill_chunk_size", None)


def start(model: nn.Module, prompt: torch.Tensor, chunk_size: int, max_bytes: int,
          attention_mask: torch.Tensor | None = None) -> list[tuple[DiskEmbedding, Lookahead]]:
    """Gives each offloaded module of ``model`` the plan of a prefill of
    ``prompt`` (``[batch, length]`` token ids, ``attention_mask`` as
    ``generate`` takes it) in chunks of ``chunk_size``; returns the modules
    that look ahead, each with the plan it was given."""
    prompt = prompt.to("cpu", torch.int64)
    if prompt.dim() != 2 or prompt.shape[1] <= chunk_size:
        return []  # one chunk: its forward reads its rows itself, nothing to overlap
    attended = _attended(prompt, attention_mask, chunk_size)
    planned = []
    try:
        for owner in model.modules():
            for child in owner.children():
                if isinstance(child, DiskEmbedding):
                    ids, dim = _prompt_ids(owner, child, prompt, attended)
                    plan = child.lookahead(ids, chunk_size, max_bytes, dim=dim)
                    if plan is not None:
                        planned.append((child, plan))
    except BaseException:
        end(planned)
        raise
    return planned


def end(planned: list[tuple[DiskEmbedding, Lookahead]]) -> None:
    """Ends the plans that :func:`start` gave: when it returns, no read of
    theirs runs.  A plan that another ``start`` (another thread's
    ``generate``) has given a module since stays."""
    for module, plan in planned:
        module.end_lookahead(plan)


def _attended(prompt: torch.Tensor, attention_mask: torch.Tensor | None, chunk_size: int
              ) -> torch.Tensor | None:
    """Which tokens of ``prompt`` the model's linear-attention mask keeps as
    they are, chunk by chunk (None: all): transformers'
    ``create_recurrent_attention_mask`` gives a 2-D ``attention_mask``'s
    columns of the chunk, except for a chunk of one token."""
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape != prompt.shape:
        return None
    attended = attention_mask.to("cpu").bool()
    length = prompt.shape[1]
    if length % chunk_size == 1:
        attended[:, -1] = True
    if chunk_size == 1:
        attended[:] = True
    return attended


def _prompt_ids(owner: nn.Module, module: DiskEmbedding, prompt: torch.Tensor,
                attended: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The ids ``module`` gathers for ``prompt`` (its tokens ``attended``, or
    all of them: None), and their length dimension."""
    if getattr(owner, "ngram_embedding", None) is module:
        batch, length = prompt.shape
        if attended is not None:
            prompt = torch.where(attended, prompt, owner.eos_token_id)
        seq_ids = torch.arange(batch).repeat_interleave(length)
        ids = _hashing(owner).row_ids(prompt.reshape(-1), seq_ids)
        return ids.view(batch, length, -1), 1
    return gathered_token_ids(module, prompt), -1


def gathered_token_ids(module: DiskEmbedding, token_ids: torch.Tensor) -> torch.Tensor:
    """The rows a token table (Gemma 3n's ``embed_tokens_per_layer``, a
    token embedding) gathers for ``token_ids``: those outside the table are
    taken as 0, as Gemma 3n takes them for its per-layer inputs."""
    in_table = (token_ids >= 0) & (token_ids < module.num_embeddings)
    return torch.where(in_table, token_ids, 0)


def _hashing(owner: nn.Module) -> NGramHashing:
    """The hashing of a transformers ``Qwen4ExpTextNGramEmbedding``, with its own constants."""
    constants = NGramConstants(
        layer_multipliers=owner.layer_multipliers.tolist(),
        head_vocab_sizes=owner.ngram_heads_vocab_sizes.tolist(),
        head_offsets=owner.ngram_heads_offsets.tolist())
    return NGramHashing(vocab_size=owner.unigram_vocab_size, eos_id=owner.eos_token_id,
                        base_size=owner.ngram_vocab_size_base, ngram_size=owner.ngram_size,
                        heads_per_ngram=owner.heads_per_ngram, seed=owner.seed,
                        ple_layer_index=owner.ple_layer_index, constants=constants)
