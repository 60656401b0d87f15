"""``generate`` with lookahead for the models ple serves.

``generate(..., prefill_chunk_size=N)`` prefills a prompt ``[batch, length]``
in chunks, ``input_ids.split(N, dim=-1)``, one forward each.  Before
transformers' own ``generate`` runs, each offloaded module (``DiskEmbedding``)
is handed the ids its forwards will gather, chunk by chunk (its
``lookahead``), so that each chunk's rows are read while the chunk before
computes; what was read ahead and not gathered is dropped when ``generate``
returns or raises.  The ids are those the module's owner gives it
(``ple.integrations.families``), from the prompt and the attention mask
``generate`` is given (without one, every token counts as attended).

A served model is marked by :class:`Served` (``model._ple_served``: its
lookahead bound), and its class's ``generate`` is ple's function, which
falls through to the class's own for any model ple does not serve.  A copy
of the model (deepcopy, pickle, torch.load, a spawned worker) carries the
mark, whose unpickling gives the class ple's ``generate`` in that process
too.
"""

from __future__ import annotations

import functools
import inspect
import operator
import threading

import torch
from torch import nn

from ple.layers.disk_embedding import DiskEmbedding
from ple.layers.lookahead import Lookahead

from ..families import family_of_module

__all__ = ["Served", "serve"]


class Served:
    """What ple keeps on a model it serves (``model._ple_served``): the
    lookahead bound of its ``generate``."""

    def __init__(self, model_class: type, lookahead_bytes: int):
        self.model_class = model_class
        self.lookahead_bytes = lookahead_bytes

    def __reduce__(self):
        return _unpickled_served, (self.model_class, self.lookahead_bytes)


_install_lock = threading.Lock()


def _unpickled_served(model_class: type, lookahead_bytes: int) -> Served:
    """A :class:`Served` of a model of ``model_class``, whose class has ple's ``generate``."""
    with _install_lock:
        _give_generate(model_class)
    return Served(model_class, lookahead_bytes)


def serve(model: nn.Module, lookahead_bytes: int) -> None:
    """Marks ``model`` (whose tables ple serves) as ple's: its ``generate``
    looks ahead ``lookahead_bytes`` per offloaded module (0: not at all)."""
    model._ple_served = _unpickled_served(type(model), lookahead_bytes)


def _give_generate(model_class: type) -> None:
    """Makes ``model_class.generate`` ple's function (once): for a model ple
    serves with a lookahead bound and a chunked prefill, the offloaded
    modules read each coming chunk's rows while the one before computes;
    for any other model it is the class's own ``generate``.  A function of
    the class, not an attribute of the model, so that whatever a user keeps
    of it (``model.generate``, a ``functools.partial`` of it, the class's
    function) holds the model as transformers' own method does, and the
    model holds nothing that refers back to it."""
    generate = getattr(model_class, "generate", None)
    if not callable(generate) or getattr(generate, "__ple_generate__", False):
        return
    signature = inspect.signature(generate)

    @functools.wraps(generate)
    def generate_with_lookahead(self, *args, **kwargs):
        served = self.__dict__.get("_ple_served")
        planned = []
        if isinstance(served, Served) and served.lookahead_bytes:
            planned = _plan(self, signature, args, kwargs, served.lookahead_bytes)
        try:
            return generate(self, *args, **kwargs)
        finally:
            end(planned)

    generate_with_lookahead.__ple_generate__ = True
    model_class.generate = generate_with_lookahead


def _plan(model: nn.Module, signature: inspect.Signature, args: tuple, kwargs: dict,
          max_bytes: int) -> list[tuple[DiskEmbedding, Lookahead]]:
    """The plans of a ``generate(*args, **kwargs)`` call of ``model``: the
    prompt and the chunk size taken as transformers' ``generate`` takes
    them (the chunk size from the keyword, else from the generation config
    given, positionally or by name, else from the model's)."""
    try:
        bound = signature.bind(model, *args, **kwargs).arguments
    except TypeError:
        return []  # transformers' generate will say what is wrong
    extra = bound.get("kwargs", {})
    prompt = bound.get("inputs")
    if prompt is None:
        prompt = extra.get("input_ids")
    chunk_size = prefill_chunk_size(model, bound.get("generation_config"), extra)
    if chunk_size is None or not isinstance(prompt, torch.Tensor):
        return []
    return start(model, prompt, chunk_size, max_bytes, extra.get("attention_mask"))


def prefill_chunk_size(model: nn.Module, generation_config, kwargs: dict) -> int | None:
    """The chunk size a ``generate`` of ``model`` with ``generation_config``
    and ``kwargs`` prefills with, as transformers merges them: the keyword
    first, then the config given, then the model's; any integer (a Python,
    NumPy or 0-d tensor one).  None when it prefills at once."""
    value = kwargs.get("prefill_chunk_size")
    for config in (generation_config, getattr(model, "generation_config", None)):
        if value is None and config is not None:
            value = getattr(config, "prefill_chunk_size", None)
    if value is None:
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None  # not an integer: transformers' generate will say so


def start(model: nn.Module, prompt: torch.Tensor, chunk_size: int, max_bytes: int,
          attention_mask: torch.Tensor | None = None) -> list[tuple[DiskEmbedding, Lookahead]]:
    """Gives each offloaded module of ``model`` the plan of a prefill of
    ``prompt`` (``[batch, length]`` token ids, ``attention_mask`` as
    ``generate`` takes it) in chunks of ``chunk_size``; returns the modules
    that look ahead, each with the plan it was given."""
    prompt = prompt.to("cpu", torch.int64)
    if prompt.dim() != 2 or chunk_size < 1 or prompt.shape[1] <= chunk_size:
        return []  # one chunk: its forward reads its rows itself, nothing to overlap
    attended = _attended(prompt, attention_mask, chunk_size)
    planned = []
    try:
        for owner in model.modules():
            for child in owner.children():
                if isinstance(child, DiskEmbedding):
                    family = family_of_module(model, owner, child)
                    ids, dim = family.prompt_ids(model, owner, child, prompt, attended)
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
