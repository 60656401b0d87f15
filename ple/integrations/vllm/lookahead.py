"""Lookahead under vLLM: in a chunked prefill, the rows of a request's next
chunks are read while its current chunk computes.

vLLM's scheduler (in the engine core) decides each step's chunks; each
worker gets them as a ``SchedulerOutput``: the new requests with their
prompt's token ids and computed tokens, the number of tokens scheduled per
request, the requests finished since the step before.  The plugin wraps the
worker's ``execute_model`` (``vllm.v1.worker.gpu_worker.Worker``, which the
CPU and XPU workers inherit, over either model runner), and before each step
:class:`PrefillLookahead` prefetches (``Table.prefetch``) the ids that each
offloaded module will gather for the request's coming chunks, at most
``PLE_LOOKAHEAD_MIB`` of rows ahead per table, so that each chunk's gather
takes its rows from the prefetch instead of reading them.

A prefetch serves a gather of its ids or of ids that begin with them, and a
forward gathers the whole batch at once, padded at its end where a CUDA
graph pads it: the chunks are read ahead only while the worker holds one
request (a lone prefill, whose next forward is its next chunk alone, of
``min(tokens left, max_num_scheduled_tokens)`` tokens as vLLM's scheduler
cuts it).  A step that forwards anything else (another request joined the
batch, a chunk cut otherwise) drops what was read ahead, and its forward
reads its own rows; so do the forwards of batched requests.  A forward that
leaves its chunk's rows untaken (ids that the lookahead did not foresee)
drops what was read ahead too, and the request is read ahead no more.  On
each table, the rows read ahead and not yet taken, as the table counts them
(``ple.layers.lookahead.ReadAhead``), stay within the bound whatever the
forwards do.  The bytes are right either way.

The ids are those the modules gather: the token ids for a ``DiskEmbedding``
(Gemma 3n's and Gemma 4's ``embed_tokens_per_layer``) as the model's family
takes them (``ple.integrations.families``); the hashed n-gram ids for an
``NGramEmbedding`` (Qwen4Exp), by its own ``NGramHashing``, the request's
``ngram_size - 1`` tokens before the chunk as its context (EOS before the
prompt), as vLLM's ``ngram_context`` gives them.

Lookahead must never break vLLM's step: an exception of its own is logged
once, its prefetches dropped, and the worker goes on without lookahead.
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from ple.layers.disk_embedding import DiskEmbedding
from ple.layers.lookahead import ReadAhead
from ple.layers.ngram_embedding import NGramEmbedding
from ple.layers.parallel import prefetch

from ..families import FAMILIES, GEMMA3N, PerLayerInputs
from .settings import settings
from .tables import logger

__all__ = ["PrefillLookahead", "install", "run_step"]


@dataclass
class Prompt:
    """A request's prompt, how far its prefill has been scheduled, the
    chunks ``(start, stop)`` whose rows are read ahead, in order, and
    whether a forward missed them."""
    token_ids: torch.Tensor  # CPU int64
    scheduled: int
    read_ahead: deque[tuple[int, int]] = field(default_factory=deque)
    missed: bool = False


class PrefillLookahead:
    """The lookahead of one worker's model: its offloaded modules, the
    requests the worker holds and the prompts of those given by token ids,
    and what is read ahead on each table.  ``chunk_tokens``: the most tokens
    vLLM schedules in a step; ``device``: the model's."""

    def __init__(self, modules: list[nn.Module], max_bytes: int, chunk_tokens: int,
                 device: torch.device, config=None):
        self.modules = modules
        # The model's config: which family's ids a token table gathers.
        self.config = config
        self.max_bytes = max_bytes
        self.chunk_tokens = chunk_tokens
        self.device = device
        self.held: set[str] = set()
        self.prompts: dict[str, Prompt] = {}
        self.tables = list({id(m.table): m.table for m in modules}.values())
        self.ahead = self._new_read_ahead()
        self._taking: Prompt | None = None  # the prompt whose next chunk this step forwards

    @classmethod
    def of_model(cls, model: nn.Module, max_bytes: int, chunk_tokens: int,
                 device: torch.device) -> PrefillLookahead | None:
        """The lookahead of ``model``'s offloaded modules; None without any."""
        modules = [m for m in model.modules() if isinstance(m, (DiskEmbedding, NGramEmbedding))]
        return (cls(modules, max_bytes, chunk_tokens, device, getattr(model, "config", None))
                if modules else None)

    def before_step(self, scheduler_output) -> None:
        """Takes the step's schedule: forgets the requests that ended, keeps
        what was read ahead for this step's forward when it is a lone
        request's next chunk (drops all of it otherwise), then reads ahead
        the chunks that follow while the worker holds that one request."""
        ended = scheduler_output.finished_req_ids | (
            getattr(scheduler_output, "preempted_req_ids", None) or set())
        self.held -= ended
        forgotten = [self.prompts.pop(req_id) for req_id in ended if req_id in self.prompts]
        if forgotten:
            self._drop()
        for new in scheduler_output.scheduled_new_reqs:
            if new.prompt_token_ids is not None and new.prompt_embeds is None:
                self.prompts[new.req_id] = Prompt(
                    torch.tensor(new.prompt_token_ids, dtype=torch.int64), new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            if req_id in cached.resumed_req_ids:  # preempted: its prompt and outputs computed again
                self.prompts.pop(req_id, None)
            elif req_id in self.prompts:
                self.prompts[req_id].scheduled = computed
        steps = scheduler_output.num_scheduled_tokens
        self.held |= steps.keys()
        forwarded = [(self.prompts.get(req_id), n) for req_id, n in steps.items()]
        prompt, n = forwarded[0] if len(forwarded) == 1 else (None, 0)
        if prompt is not None and prompt.read_ahead and \
                prompt.read_ahead[0] == (prompt.scheduled, prompt.scheduled + n):
            prompt.read_ahead.popleft()  # this forward takes it
            self._taking = prompt
        elif any(p.read_ahead for p in self.prompts.values()):
            self._drop()
        for prompt, n in forwarded:
            if prompt is not None:
                prompt.scheduled += n
        if len(self.held) == 1 and (lone := self.prompts.get(next(iter(self.held)))):
            self._read_ahead(lone)

    def after_step(self) -> None:
        """The step's forward has enqueued its gathers: on the CPU they have
        run.  What the chunk it was to take left untaken is dropped, and so
        is everything read ahead, the request being read ahead no more."""
        taking, self._taking = self._taking, None
        if taking is not None:
            for ahead in self.ahead.values():
                ahead.forwarded(self.device)
        if any(ahead.missed for ahead in self.ahead.values()):
            if taking is not None:
                taking.missed = True
            self._drop()

    def close(self) -> None:
        """Drops what was read ahead and forgets the requests."""
        self.held.clear()
        self.prompts.clear()
        self._drop()

    def _read_ahead(self, prompt: Prompt) -> None:
        """Prefetches the prompt's next chunks while their rows fit in
        max_bytes on every table (always one)."""
        length = prompt.token_ids.numel()
        start = prompt.read_ahead[-1][1] if prompt.read_ahead else prompt.scheduled
        while start < length and not prompt.missed:
            stop = min(length, start + self.chunk_tokens)
            on_table = {id(table): 0 for table in self.tables}
            for module in self.modules:
                on_table[id(module.table)] += (stop - start) * _ids_per_token(module) * \
                    module.table.row_bytes
            if not all(ahead.room_for(on_table[key]) for key, ahead in self.ahead.items()):
                return
            tickets = {key: [] for key in self.ahead}
            for module in self.modules:
                tickets[id(module.table)].append(_prefetch(
                    module, self.config, prompt.token_ids, start, stop,
                    self.ahead[id(module.table)].owner))
            for key, ahead in self.ahead.items():
                ahead.add(tickets[key])
            prompt.read_ahead.append((start, stop))
            start = stop

    def _drop(self) -> None:
        """Drops what was read ahead: when it returns, none of it is read."""
        for prompt in self.prompts.values():
            prompt.read_ahead.clear()
        self._taking = None
        for ahead in self.ahead.values():
            ahead.end()
        self.ahead = self._new_read_ahead()

    def _new_read_ahead(self) -> dict[int, ReadAhead]:
        return {id(table): ReadAhead(table, self.max_bytes) for table in self.tables}


def _ids_per_token(module: nn.Module) -> int:
    return module.hashing.heads if isinstance(module, NGramEmbedding) else 1


def _prefetch(module: nn.Module, config, token_ids: torch.Tensor, start: int, stop: int,
              owner: int) -> int:
    """Prefetches for ``owner`` the ids ``module`` (of a model of ``config``)
    gathers for the prompt's tokens ``[start, stop)`` forwarded alone;
    returns the prefetch's ticket."""
    chunk = token_ids[start:stop]
    if isinstance(module, NGramEmbedding):
        history = module.hashing.context_size
        before = token_ids[max(0, start - history):start]
        eos = torch.full((history - before.numel(),), module.hashing.eos_id, dtype=torch.int64)
        ids = module.row_ids(chunk, None, torch.cat([eos, before]).unsqueeze(0))
    else:
        family = FAMILIES.get(getattr(config, "model_type", None))
        ids = (family if isinstance(family, PerLayerInputs) else GEMMA3N).token_ids(
            config, module, chunk)
    return prefetch(module.table, ids, module.split, owner)


# Each worker's lookahead (None: its model has no offloaded table, or
# lookahead is off or failed), built at its first step.
_lookaheads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def install() -> None:
    """Wraps vLLM's worker ``execute_model`` (once per process) in
    :func:`run_step`."""
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker.execute_model, "ple_lookahead", False):
        return
    execute_model = Worker.execute_model

    @functools.wraps(execute_model)
    def with_lookahead(worker, scheduler_output):
        return run_step(worker, scheduler_output, functools.partial(execute_model, worker))

    with_lookahead.ple_lookahead = True
    Worker.execute_model = with_lookahead


def run_step(worker, scheduler_output, execute_model):
    """``execute_model(scheduler_output)`` of ``worker`` with the lookahead
    of its model, read from the settings at its first step (an engine built
    later in the process reads them anew)."""
    if worker not in _lookaheads:
        settings()  # a bad setting stops the engine here, as at load, outside the guard
    lookahead = _guarded(worker, _lookahead_of, worker)
    if lookahead is not None:
        _guarded(worker, lookahead.before_step, scheduler_output)
    try:
        return execute_model(scheduler_output)
    finally:
        if lookahead is not None:
            _guarded(worker, lookahead.after_step)


def _lookahead_of(worker) -> PrefillLookahead | None:
    if worker in _lookaheads:
        return _lookaheads[worker]
    mib = settings().lookahead_mib
    lookahead = None
    if mib:
        scheduler = worker.vllm_config.scheduler_config
        chunk_tokens = scheduler.max_num_scheduled_tokens or scheduler.max_num_batched_tokens
        lookahead = PrefillLookahead.of_model(worker.model_runner.get_model(), mib << 20,
                                              chunk_tokens, worker.device)
    _lookaheads[worker] = lookahead
    return lookahead


def _guarded(worker, step, *args):
    """``step(*args)``; on an exception, logs it once for the worker, drops
    what was read ahead and turns its lookahead off: a failed prefetch only
    loses the overlap."""
    try:
        return step(*args)
    except Exception:
        lookahead = _lookaheads.get(worker)
        _lookaheads[worker] = None
        logger.warning("ple: lookahead failed and is off for this engine; its gathers read "
                       "their own rows", exc_info=True)
        if lookahead is not None:
            try:
                lookahead.close()
            except Exception:
                logger.debug("ple: dropping the prefetches failed too", exc_info=True)
        return None
