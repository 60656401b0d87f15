"""The lookup grids of GGUF's i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
IQ3_XXS, IQ3_S), for the Triton decoder (kernels/decode_gguf_iq_triton.py):
each grid as its values, int8 ``[entries, width]``, one table a grid (IQ1_M
decodes with IQ1_S's).

A block of these types stores, for each group of 4 or 8 values, an index
into its grid: an entry of 4 or 8 small values (three levels for the
IQ1 and IQ2 grids, eight for the IQ3 ones) that the block's scale and
signs multiply.  The grids are the gguf package's own (``grid_hex`` of its
classes in gguf.quants): hexadecimal text, two digits a byte, each byte
holding ``8 // stride`` level indices of ``stride`` bits from its low bits
up (2 bits for three levels, 4 for eight), each an index into the class's
``grid_map`` (the levels).
"""

from __future__ import annotations

import functools

import numpy as np
from gguf import quants

# The gguf class whose grid each i-quant format decodes with.
GRID_OF_FORMAT = {"iq2_xxs": "IQ2_XXS", "iq2_xs": "IQ2_XS", "iq2_s": "IQ2_S",
                  "iq3_xxs": "IQ3_XXS", "iq3_s": "IQ3_S", "iq1_s": "IQ1_S", "iq1_m": "IQ1_S"}


@functools.cache
def grid(name: str) -> np.ndarray:
    """The grid of the gguf class ``name`` (a value of GRID_OF_FORMAT): int8
    ``[entries, width]``, read-only."""
    cls = getattr(quants, name)
    levels = np.array(cls.grid_map, dtype=np.int8)
    bits = (len(levels) - 1).bit_length()
    per_byte = 8 // bits
    stride = 8 // per_byte
    packed = np.frombuffer(bytes.fromhex(cls.grid_hex.decode("ascii")), dtype=np.uint8)
    shifts = np.arange(per_byte, dtype=np.uint8) * stride
    indices = (packed[:, None] >> shifts) & ((1 << bits) - 1)
    values = levels[indices].reshape(cls.grid_shape)
    values.flags.writeable = False
    return values


def format_grid(fmt: str) -> np.ndarray:
    """The grid of the i-quant row format ``fmt`` (a key of GRID_OF_FORMAT)."""
    return grid(GRID_OF_FORMAT[fmt])
