"""The row ids a hashed n-gram PLE layer gathers for each token (design.md §3).

Our reading of the reference model, implemented exactly:

- ``splitmix64(x)``: the SplitMix64 output function on uint64,
  ``z = x + 0x9E3779B97F4A7C15; z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9;
  z = (z ^ z >> 27) * 0x94D049BB133111EB; z ^ z >> 31``, all mod 2**64.
- Three multipliers per layer, shared by its heads:
  ``m_i = 2 * (splitmix64(seed + 10007 * layer_id + 0x9E3779B97F4A7C15 * (i + 1)) % half) + 1``
  for i = 0, 1, 2 (the argument mod 2**64), ``half = ((2**63 - 1) // vocab_size) // 2``.
  ``m_i < 2**63``, and ``token * m_i`` cannot overflow int64 for a token below
  ``vocab_size``.
- ``bigram_heads`` heads, then ``trigram_heads`` heads. Their sizes are consecutive
  primes above ``base_size`` (the first is the smallest prime > ``base_size``, each
  next the smallest prime > the one before); their offsets are cumulative from
  ``row_offset``. The layer needs ``rows`` = the sum of the sizes.
- Token t with ``cur``, ``prev``, ``prev2``, in int64 arithmetic that wraps:
  ``mixed2 = (cur * m0) ^ (prev * m1)``, ``mixed3 = mixed2 ^ (prev2 * m2)``; a bigram
  head uses mixed2, a trigram head mixed3; ``row = mixed mod size_h`` (floor
  modulo, so never negative) ``+ offset_h``.
- History: a missing previous token is ``pad_id``. ``eos_id`` ends a document: a
  token whose ``prev`` is EOS sees ``prev = prev2 = pad_id``, one whose ``prev2``
  (but not ``prev``) is EOS sees ``prev2 = pad_id``. EOS itself is hashed with its
  own history. The rule applies to context tokens too.
- A batch is a flat ``[T]`` tensor of several requests back to back: ``seq_ids``
  ``[T]`` gives each token's request (an index into ``context``; requests are
  contiguous), ``context`` ``[R, 2]`` the ``(prev2, prev)`` of each request's first
  token, i.e. the last two tokens of its previous step (``pad_id`` where none).

``NGramHashing.row_ids`` is a handful of int64 torch ops on the ids' own device:
no host syncs and no data-dependent shapes, so it runs inside
``torch.compile(fullgraph=True)`` and CUDA graph capture, and the same call on
CPU tensors (the prefetch's host copy) gives identical ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["NGramHashing", "splitmix64", "is_prime", "next_prime"]

_MASK64 = (1 << 64) - 1
_INT64_MAX = (1 << 63) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def splitmix64(x: int) -> int:
    """The SplitMix64 output function of ``x`` (taken mod 2**64), as a uint64."""
    z = (x + _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


# These witnesses decide Miller-Rabin for every n < 3.3 * 10**24, all of uint64.
_MILLER_RABIN_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin primality test, exact for n < 3.3 * 10**24."""
    if n < 2:
        return False
    for p in _MILLER_RABIN_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MILLER_RABIN_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(n: int) -> int:
    """The smallest prime greater than ``n``."""
    candidate = max(n + 1, 2)
    while not is_prime(candidate):
        candidate += 1
    return candidate


def _check_int(name: str, value) -> None:
    # bool is an int subclass, but True as a vocabulary size is a caller's mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


@dataclass(frozen=True)
class NGramHashing:
    """The hashing of one PLE layer: its multipliers, head sizes and offsets, and
    ``row_ids``, the rows each token of a batch gathers."""

    vocab_size: int
    eos_id: int
    layer_id: int
    base_size: int
    seed: int = 1234
    bigram_heads: int = 8
    trigram_heads: int = 8
    pad_id: int = 0
    row_offset: int = 0

    multipliers: tuple[int, int, int] = field(init=False)
    head_sizes: tuple[int, ...] = field(init=False)
    head_offsets: tuple[int, ...] = field(init=False)
    rows: int = field(init=False)
    # (head sizes, head offsets) as int64 tensors per device, built by the first
    # eager call there.
    _head_tensors: dict = field(init=False, default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "eos_id", "layer_id", "base_size", "seed", "bigram_heads",
                     "trigram_heads", "pad_id", "row_offset"):
            _check_int(name, getattr(self, name))
        if not 1 <= self.vocab_size <= _INT64_MAX // 2:
            raise ValueError(f"vocab_size must be in [1, 2**62 - 1], got {self.vocab_size}")
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(f"eos_id must be in [0, vocab_size={self.vocab_size}), got {self.eos_id}")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"pad_id must be in [0, vocab_size={self.vocab_size}), got {self.pad_id}")
        if self.layer_id < 0:
            raise ValueError(f"layer_id must be >= 0, got {self.layer_id}")
        if self.base_size < 1:
            raise ValueError(f"base_size must be >= 1, got {self.base_size}")
        if self.bigram_heads < 0 or self.trigram_heads < 0:
            raise ValueError(f"bigram_heads and trigram_heads must be >= 0, "
                             f"got {self.bigram_heads} and {self.trigram_heads}")
        if self.bigram_heads + self.trigram_heads == 0:
            raise ValueError("a layer needs at least one head, got bigram_heads=0 and trigram_heads=0")
        if self.row_offset < 0:
            raise ValueError(f"row_offset must be >= 0, got {self.row_offset}")

        half = (_INT64_MAX // self.vocab_size) // 2
        multipliers = tuple(
            2 * (splitmix64(self.seed + 10007 * self.layer_id + _GOLDEN_GAMMA * (i + 1)) % half) + 1
            for i in range(3))
        sizes, offsets = [], []
        size, offset = self.base_size, self.row_offset
        for _ in range(self.bigram_heads + self.trigram_heads):
            size = next_prime(size)
            sizes.append(size)
            offsets.append(offset)
            offset += size
        if offset - 1 > _INT64_MAX:
            raise ValueError(f"the layer's last row {offset - 1} does not fit in int64")
        object.__setattr__(self, "multipliers", multipliers)
        object.__setattr__(self, "head_sizes", tuple(sizes))
        object.__setattr__(self, "head_offsets", tuple(offsets))
        object.__setattr__(self, "rows", offset - self.row_offset)

    @property
    def heads(self) -> int:
        return self.bigram_heads + self.trigram_heads

    def head_tensors(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(head_sizes, head_offsets)`` as int64 tensors on ``device``, cached.

        Building them copies from the host, which CUDA graph capture forbids: call
        ``row_ids`` (or this) once on the device before capturing. A compiled
        ``row_ids`` needs no such call: it holds them as constants of its graph.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if torch.compiler.is_compiling():
            # Cached from inside a compiled graph, they would be outputs of that graph,
            # which the next replay of its CUDA graph (mode="reduce-overhead") overwrites.
            return self._build_head_tensors(device)
        cached = self._head_tensors.get(device)
        if cached is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"NGramHashing: call row_ids once on {device} before capturing a CUDA graph "
                                   f"(its first call there copies the head sizes from the host)")
            cached = self._head_tensors[device] = self._build_head_tensors(device)
        return cached

    def _build_head_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor(self.head_sizes, dtype=torch.int64, device=device),
                torch.tensor(self.head_offsets, dtype=torch.int64, device=device))

    def row_ids(self, token_ids: torch.Tensor, seq_ids: torch.Tensor | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of each token: ``[T, heads]`` int64 on ``token_ids``' device,
        bigram heads first, each in ``[row_offset, row_offset + rows)``.

        ``token_ids`` ``[T]``: several requests back to back. ``seq_ids`` ``[T]``:
        each token's request, an index into ``context`` (None: one request).
        ``context`` ``[R, 2]``: ``(prev2, prev)`` of each request's first token
        (None: no request has context). Ids are not range-checked (that would
        sync with the device); a token outside the vocabulary still hashes, wrapping.
        """
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D [T], got shape {tuple(token_ids.shape)}")
        device = token_ids.device
        num_tokens = token_ids.shape[0]
        if seq_ids is not None and (seq_ids.shape != token_ids.shape or seq_ids.device != device):
            raise ValueError(f"seq_ids must be [T] on token_ids' device ({tuple(token_ids.shape)}, {device}), "
                             f"got {tuple(seq_ids.shape)} on {seq_ids.device}")
        if context is not None:
            if context.dim() != 2 or context.shape[1] != 2 or context.device != device:
                raise ValueError(f"context must be [R, 2] on token_ids' device ({device}), "
                                 f"got {tuple(context.shape)} on {context.device}")
            if seq_ids is None and context.shape[0] != 1:
                raise ValueError(f"without seq_ids the batch is one request, so context must be [1, 2], "
                                 f"got {tuple(context.shape)}")

        tokens = token_ids.long()
        positions = torch.arange(num_tokens, device=device)
        # Whether token t-1 (t-2) exists and belongs to token t's request.
        has_prev = positions >= 1
        has_prev2 = positions >= 2
        if seq_ids is not None:
            seq = seq_ids.long()
            has_prev = has_prev & (seq == _shift(seq, 1, 0))
            has_prev2 = has_prev2 & (seq == _shift(seq, 2, 0))

        if context is None:
            context_prev = context_prev2 = torch.full_like(tokens, self.pad_id)
        else:
            request_context = context.long()[seq if seq_ids is not None else torch.zeros_like(tokens)]
            context_prev2, context_prev = request_context[:, 0], request_context[:, 1]
        prev = torch.where(has_prev, _shift(tokens, 1, self.pad_id), context_prev)
        # The second token of a request reaches back to the context's last token.
        prev2 = torch.where(has_prev2, _shift(tokens, 2, self.pad_id),
                            torch.where(has_prev, context_prev, context_prev2))

        prev_is_eos = prev == self.eos_id
        prev2 = torch.where(prev_is_eos | (prev2 == self.eos_id), self.pad_id, prev2)
        prev = torch.where(prev_is_eos, self.pad_id, prev)

        m0, m1, m2 = self.multipliers
        mixed2 = torch.bitwise_xor(tokens * m0, prev * m1)
        mixed3 = torch.bitwise_xor(mixed2, prev2 * m2)
        mixed = torch.cat([mixed2.unsqueeze(1).expand(num_tokens, self.bigram_heads),
                           mixed3.unsqueeze(1).expand(num_tokens, self.trigram_heads)], dim=1)
        sizes, offsets = self.head_tensors(device)
        return torch.remainder(mixed, sizes) + offsets


def _shift(values: torch.Tensor, by: int, fill: int) -> torch.Tensor:
    """``values`` moved ``by`` places later, the first ``by`` places ``fill``; same length."""
    return torch.cat([values.new_full((by,), fill), values])[: values.shape[0]]
