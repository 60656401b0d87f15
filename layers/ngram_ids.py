"""The row ids a hashed n-gram PLE layer gathers for each token, as the
reference model (transformers' ``Qwen4ExpTextNGramEmbedding``) computes them.

- ``splitmix64(x)``: the SplitMix64 output function on uint64,
  ``z = x + 0x9E3779B97F4A7C15; z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9;
  z = (z ^ z >> 27) * 0x94D049BB133111EB; z ^ z >> 31``, all mod 2**64.
- ``ngram_size`` multipliers per layer, shared by its heads:
  ``m_i = 2 * (splitmix64(seed + 10007 * ple_layer_index + 0x9E3779B97F4A7C15 * (i + 1)) % half) + 1``
  (the argument mod 2**64), ``half = max(1, ((2**63 - 1) // vocab_size) // 2)``.
  ``token * m_i`` cannot overflow int64 for a token below ``vocab_size``.
- ``H = (ngram_size - 1) * heads_per_ngram`` heads: ``heads_per_ngram`` of the
  2-gram, then as many of the 3-gram, and so on.  One prime sequence runs
  across all PLE layers: global head ``g = ple_layer_index * H + h`` has as its
  size the ``(g + 1)``-th prime after ``base_size - 1`` (the first is the
  smallest prime >= ``base_size``).  Offsets are cumulative from
  ``row_offset`` inside the layer.
- History: a request's tokens follow its context, the ``ngram_size - 1``
  tokens before this step (all EOS for a new request).  Shift ``s`` of a
  token is the token ``s`` places back when no EOS lies between them (that
  token included); otherwise EOS.  EOS itself is hashed with its own history.
- ``mixed_n = xor over j < n of (shift_j * m_j)`` in int64 arithmetic that
  wraps (``shift_0`` is the token); a head of the n-gram block takes
  ``floor_mod(mixed_n, size_h) + offset_h``.
- A checkpoint's own constants (``layer_multipliers``, head sizes, head
  offsets; :class:`NGramConstants`) replace the derived ones when it has them.

``NGramHashing.row_ids`` is a handful of int64 torch ops on the ids' own device:
no host syncs and no data-dependent shapes, so it runs inside
``torch.compile(fullgraph=True)`` and CUDA graph capture, and the same call on
CPU tensors (the prefetch's host copy) gives identical ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["NGramConstants", "NGramHashing", "decoder_layer", "ple_layer_index", "splitmix64", "is_prime",
           "next_prime"]

_MASK64 = (1 << 64) - 1
_INT64_MAX = (1 << 63) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_LAYER_SEED_STRIDE = 10007


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


def _config_value(config, key: str):
    """``config[key]`` of a dict or ``config.key`` of a transformers config;
    a composite (vision-language) config's text part answers for it."""
    text = config.get("text_config") if isinstance(config, Mapping) else getattr(config, "text_config", None)
    if text is not None:
        config = text
    value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    if value is None:
        raise KeyError(f"the model config has no {key!r}")
    return value


def ple_layer_index(config, decoder_layer: int) -> int:
    """The PLE layer index of 0-based decoder layer ``decoder_layer``: the
    position of ``decoder_layer + 1`` in the config's sorted ``ple_layer_ids``."""
    layer_numbers = sorted(set(_config_value(config, "ple_layer_ids")))
    if decoder_layer + 1 not in layer_numbers:
        raise ValueError(f"decoder layer {decoder_layer} has no PLE (ple_layer_ids are the 1-based "
                         f"layers {layer_numbers})")
    return layer_numbers.index(decoder_layer + 1)


def decoder_layer(config, ple_layer_index: int) -> int:
    """The 0-based decoder layer of PLE layer ``ple_layer_index`` (the inverse
    of :func:`ple_layer_index`)."""
    layer_numbers = sorted(set(_config_value(config, "ple_layer_ids")))
    if not 0 <= ple_layer_index < len(layer_numbers):
        raise ValueError(f"ple_layer_index must be in [0, {len(layer_numbers)}) for this config's "
                         f"{len(layer_numbers)} PLE layers, got {ple_layer_index}")
    return layer_numbers[ple_layer_index] - 1


@dataclass(frozen=True)
class NGramConstants:
    """A checkpoint's own hashing constants for one layer; each None where the
    file has none (then the derived value stands)."""

    layer_multipliers: tuple[int, ...] | None = None
    head_vocab_sizes: tuple[int, ...] | None = None
    head_offsets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("layer_multipliers", "head_vocab_sizes", "head_offsets"):
            values = getattr(self, name)
            if values is not None:
                values = tuple(values)
                for value in values:
                    _check_int(f"{name} entries", value)
                object.__setattr__(self, name, values)

    @classmethod
    def coerce(cls, constants: "NGramConstants | Mapping[str, Sequence[int]] | None") -> "NGramConstants":
        """``constants`` as an ``NGramConstants``: a mapping may use these field
        names or transformers' buffer names (``ngram_heads_vocab_sizes``,
        ``ngram_heads_offsets``)."""
        if constants is None:
            return cls()
        if isinstance(constants, cls):
            return constants
        aliases = {"ngram_heads_vocab_sizes": "head_vocab_sizes", "ngram_heads_offsets": "head_offsets"}
        fields = {}
        for key, values in constants.items():
            name = aliases.get(key, key)
            if name not in ("layer_multipliers", "head_vocab_sizes", "head_offsets"):
                raise ValueError(f"unknown n-gram constant {key!r}")
            fields[name] = [int(v) for v in values]
        return cls(**fields)


@dataclass(frozen=True)
class NGramHashing:
    """The hashing of one PLE layer: its multipliers, head sizes and offsets, and
    ``row_ids``, the rows each token of a batch gathers."""

    vocab_size: int
    eos_id: int
    base_size: int = field(default=20_000_000, kw_only=True)
    ple_layer_index: int = field(default=0, kw_only=True)
    ngram_size: int = field(default=3, kw_only=True)
    heads_per_ngram: int = field(default=8, kw_only=True)
    seed: int = field(default=1234, kw_only=True)
    row_offset: int = field(default=0, kw_only=True)
    constants: NGramConstants | None = field(default=None, kw_only=True)

    multipliers: tuple[int, ...] = field(init=False)
    head_sizes: tuple[int, ...] = field(init=False)
    head_offsets: tuple[int, ...] = field(init=False)
    rows: int = field(init=False)
    # (multipliers, head sizes, head offsets) as int64 tensors per device, built
    # by the first eager call there.
    _tensors: dict = field(init=False, default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "eos_id", "base_size", "ple_layer_index", "ngram_size",
                     "heads_per_ngram", "seed", "row_offset"):
            _check_int(name, getattr(self, name))
        if not 1 <= self.vocab_size <= _INT64_MAX // 2:
            raise ValueError(f"vocab_size must be in [1, 2**62 - 1], got {self.vocab_size}")
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(f"eos_id must be in [0, vocab_size={self.vocab_size}), got {self.eos_id}")
        for name, least in (("base_size", 1), ("ple_layer_index", 0), ("ngram_size", 2),
                            ("heads_per_ngram", 1), ("row_offset", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        constants = NGramConstants.coerce(self.constants)
        object.__setattr__(self, "constants", constants)

        multipliers = constants.layer_multipliers or self._derived_multipliers()
        sizes = constants.head_vocab_sizes or self._derived_head_sizes()
        if constants.head_offsets is not None:
            offsets = tuple(self.row_offset + offset for offset in constants.head_offsets)
        else:
            offsets = tuple(self.row_offset + sum(sizes[:h]) for h in range(len(sizes)))
        for name, values, length in (("layer_multipliers", multipliers, self.ngram_size),
                                     ("head_vocab_sizes", sizes, self.heads),
                                     ("head_offsets", offsets, self.heads)):
            if len(values) != length:
                raise ValueError(f"{name} has {len(values)} entries, but a layer of ngram_size "
                                 f"{self.ngram_size} and {self.heads_per_ngram} heads per n-gram needs "
                                 f"{length}")
        if min(sizes) < 1 or min(offsets) < self.row_offset:
            raise ValueError(f"head sizes must be >= 1 and offsets >= 0, got sizes {sizes} and "
                             f"offsets {tuple(o - self.row_offset for o in offsets)}")
        end = max(offset + size for offset, size in zip(offsets, sizes))
        if end - 1 > _INT64_MAX:
            raise ValueError(f"the layer's last row {end - 1} does not fit in int64")
        object.__setattr__(self, "multipliers", tuple(multipliers))
        object.__setattr__(self, "head_sizes", tuple(sizes))
        object.__setattr__(self, "head_offsets", offsets)
        object.__setattr__(self, "rows", end - self.row_offset)

    @classmethod
    def from_config(cls, config, ple_layer_index: int = 0, **overrides) -> "NGramHashing":
        """The hashing of PLE layer ``ple_layer_index`` of a model config: a
        transformers ``Qwen4ExpTextConfig`` (or its composite config) or a
        dict with the same keys.  ``overrides`` (``row_offset``,
        ``constants``, ...) go to the constructor."""
        eos = _config_value(config, "eos_token_id")
        if isinstance(eos, (list, tuple)):
            eos = eos[0]  # the reference model's rule
        decoder_layer(config, ple_layer_index)  # checks that the config has this PLE layer
        args = dict(vocab_size=_config_value(config, "vocab_size"), eos_id=eos,
                    base_size=_config_value(config, "ngram_vocab_size_base"),
                    ngram_size=_config_value(config, "ngram_size"),
                    heads_per_ngram=_config_value(config, "heads_per_ngram"),
                    seed=_config_value(config, "seed"), ple_layer_index=ple_layer_index)
        return cls(**(args | overrides))

    def _derived_multipliers(self) -> tuple[int, ...]:
        half = max(1, (_INT64_MAX // self.vocab_size) // 2)
        layer_seed = self.seed + _LAYER_SEED_STRIDE * self.ple_layer_index
        return tuple(2 * (splitmix64(layer_seed + _GOLDEN_GAMMA * (i + 1)) % half) + 1
                     for i in range(self.ngram_size))

    def _derived_head_sizes(self) -> tuple[int, ...]:
        prime = self.base_size - 1
        for _ in range(self.ple_layer_index * self.heads):  # the earlier layers' heads
            prime = next_prime(prime)
        sizes = []
        for _ in range(self.heads):
            prime = next_prime(prime)
            sizes.append(prime)
        return tuple(sizes)

    @property
    def heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def context_size(self) -> int:
        """Tokens of history a request carries from one step to the next."""
        return self.ngram_size - 1

    def padded_rows(self, multiple: int) -> int:
        """The layer's rows rounded up to ``multiple``, as the reference model
        sizes its table (``make_ngram_vocab_size_divisible_by``)."""
        return -(-self.rows // multiple) * multiple

    def constant_tensors(self, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        """``(multipliers, head_sizes, head_offsets)`` as int64 tensors on
        ``device``, cached.

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
            return self._build_tensors(device)
        cached = self._tensors.get(device)
        if cached is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"NGramHashing: call row_ids once on {device} before capturing a CUDA graph "
                                   f"(its first call there copies the head sizes from the host)")
            cached = self._tensors[device] = self._build_tensors(device)
        return cached

    def _build_tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        return tuple(torch.tensor(values, dtype=torch.int64, device=device)
                     for values in (self.multipliers, self.head_sizes, self.head_offsets))

    def row_ids(self, token_ids: torch.Tensor, seq_ids: torch.Tensor | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of each token: ``[T, heads]`` int64 on ``token_ids``' device,
        the 2-gram heads first, each in ``[row_offset, row_offset + rows)``.

        ``token_ids`` ``[T]``: several requests back to back. ``seq_ids`` ``[T]``:
        each token's request, an index into ``context`` (None: one request);
        a request's tokens are contiguous. ``context`` ``[R, ngram_size - 1]``:
        each request's last tokens before this step, oldest first (None: every
        request is new, as if its context were all EOS). Ids are not
        range-checked (that would sync with the device); a token outside the
        vocabulary still hashes, wrapping.
        """
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D [T], got shape {tuple(token_ids.shape)}")
        device = token_ids.device
        history = self.context_size
        if seq_ids is not None and (seq_ids.shape != token_ids.shape or seq_ids.device != device):
            raise ValueError(f"seq_ids must be [T] on token_ids' device ({tuple(token_ids.shape)}, {device}), "
                             f"got {tuple(seq_ids.shape)} on {seq_ids.device}")
        if context is not None:
            if context.dim() != 2 or context.shape[1] != history or context.device != device:
                raise ValueError(f"context must be [R, {history}] (ngram_size - 1 tokens, oldest first) "
                                 f"on token_ids' device ({device}), got {tuple(context.shape)} on "
                                 f"{context.device}")
            if seq_ids is None and context.shape[0] != 1:
                raise ValueError(f"without seq_ids the batch is one request, so context must be "
                                 f"[1, {history}], got {tuple(context.shape)}")

        tokens = token_ids.long()
        positions = torch.arange(tokens.shape[0], device=device)
        seq = None if seq_ids is None else seq_ids.long()
        # in_request[s - 1]: the token s places back exists in this batch and is
        # in the same request.
        in_request = []
        for shift in range(1, history + 1):
            same = positions >= shift
            if seq is not None:
                same = same & (seq == _shift(seq, shift, 0))
            in_request.append(same)
        if context is not None:
            request_context = context.long()[seq if seq is not None else torch.zeros_like(tokens)]
            # How many earlier tokens of its request this batch holds, at most `history`.
            earlier = torch.stack(in_request).sum(0)

        shifted = [tokens]
        no_eos_between = torch.ones_like(tokens, dtype=torch.bool)
        for shift in range(1, history + 1):
            back = _shift(tokens, shift, self.eos_id)
            if context is None:
                reached = torch.where(in_request[shift - 1], back, self.eos_id)
            else:
                # The token before the request's first reaches into its context.
                slot = (history - shift + earlier).clamp(0, history - 1)
                from_context = request_context.gather(1, slot.unsqueeze(1)).squeeze(1)
                reached = torch.where(in_request[shift - 1], back, from_context)
            no_eos_between = no_eos_between & (reached != self.eos_id)
            shifted.append(torch.where(no_eos_between, reached, self.eos_id))

        multipliers, sizes, offsets = self.constant_tensors(device)
        mixed = shifted[0] * multipliers[0]
        blocks = []
        for n in range(2, self.ngram_size + 1):
            mixed = torch.bitwise_xor(mixed, shifted[n - 1] * multipliers[n - 1])
            blocks.append(mixed.unsqueeze(1).expand(tokens.shape[0], self.heads_per_ngram))
        return torch.remainder(torch.cat(blocks, dim=1), sizes) + offsets


def _shift(values: torch.Tensor, by: int, fill: int) -> torch.Tensor:
    """``values`` moved ``by`` places later, the first ``by`` places ``fill``; same length."""
    return torch.cat([values.new_full((by,), fill), values])[: values.shape[0]]
