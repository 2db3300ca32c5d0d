"""The byte orders quantized codes are stored in: two 4-bit codes to a byte, and the panels the integer kernels read.

4-bit codes are packed two to a byte along ``in``: byte ``j`` of a row holds weight ``2j`` in its low
nibble and weight ``2j+1`` in its high nibble (``pack_nibbles``). int4 layers served by the integer kernel
store the same bytes in panels of 8 rows instead (``pack_nibble_panels``), the order that kernel reads;
int8 layers likewise in panels of 16 rows (``pack_int8_panels``). The codes themselves come from
quant/schemes.py; these orders change when a kernel in native/csrc reads its weights differently.
"""

from __future__ import annotations

import torch


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 ``[out, in]`` -> ``[out, in // 2]``: even index in the low nibble, odd in the high."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: ``[out, in // 2]`` -> uint8 ``[out, in]``."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=2).view(packed.shape[0], packed.shape[1] * 2)


INT4_PANEL_ROWS = 8  # output rows per panel (pack_nibble_panels): one AVX2 vector of float32 outputs


def pack_nibble_panels(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 ``[out, in]`` -> ``[out, in // 2]`` bytes in panels of ``INT4_PANEL_ROWS`` rows.

    Rows ``8p .. 8p + 7`` become one run of ``in * 4`` bytes, in chunks of 8 inputs: byte ``4r + i`` of chunk
    ``t`` holds ``codes[8p + r, 8t + i]`` in its low nibble and ``codes[8p + r, 8t + 4 + i]`` in its high one.
    So one 32-byte load gives the int4 kernel 8 rows x 8 inputs, each output row in its own lane (an outer
    product, no horizontal sums), and a panel is read front to back. The tensor keeps the shape of
    ``pack_nibbles``'s, so a slice of whole panels (rows ``8a .. 8b``) is still a view of those rows.

    Raises:
        ValueError: ``out`` not a multiple of 8 or ``in`` not a multiple of 8.
    """
    out, inp = codes.shape
    if out % INT4_PANEL_ROWS or inp % 8:
        raise ValueError(f"panels need out and in to be multiples of 8, got [{out}, {inp}]")
    c = codes.to(torch.uint8).reshape(out // INT4_PANEL_ROWS, INT4_PANEL_ROWS, inp // 8, 2, 4)  # [panel, r, t, half, i]
    c = c.permute(0, 2, 1, 4, 3)  # [panel, t, r, i, half]
    return (c[..., 0] | (c[..., 1] << 4)).contiguous().view(out, inp // 2)


def unpack_nibble_panels(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibble_panels``: ``[out, in // 2]`` -> uint8 codes ``[out, in]``."""
    out, inp = packed.shape[0], packed.shape[1] * 2
    v = packed.reshape(out // INT4_PANEL_ROWS, inp // 8, INT4_PANEL_ROWS, 4)  # [panel, t, r, i]
    c = torch.stack((v & 0x0F, v >> 4), dim=-1)  # [panel, t, r, i, half]
    return c.permute(0, 2, 1, 4, 3).reshape(out, inp)


INT8_PANEL_ROWS = 16  # output rows per int8 panel (pack_int8_panels): two AVX2 vectors of float32 outputs


def pack_int8_panels(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes ``[out, in]`` -> the same bytes in panels of ``INT8_PANEL_ROWS`` rows, shape kept.

    Rows ``16p .. 16p + 15`` become one run of ``16 * in`` bytes, in pairs of inputs: byte ``2r + j`` of pair
    ``i`` is ``codes[16p + r, 2i + j]``. The int8 kernel widens a pair's 32 bytes to int16 and multiplies
    them with the activation's two int16 codes in one vpmaddwd, each output row in its own lane. As with
    ``pack_nibble_panels``, a slice of whole panels is still a view of those rows.

    Raises:
        ValueError: ``out`` not a multiple of 16 or ``in`` odd.
    """
    out, inp = codes.shape
    if out % INT8_PANEL_ROWS or inp % 2:
        raise ValueError(f"int8 panels need out a multiple of 16 and in even, got [{out}, {inp}]")
    c = codes.reshape(out // INT8_PANEL_ROWS, INT8_PANEL_ROWS, inp // 2, 2)  # [panel, r, pair, j]
    return c.permute(0, 2, 1, 3).contiguous().view(out, inp)


def unpack_int8_panels(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int8_panels``: row-major int8 codes ``[out, in]``."""
    out, inp = packed.shape
    c = packed.reshape(out // INT8_PANEL_ROWS, inp // 2, INT8_PANEL_ROWS, 2)  # [panel, pair, r, j]
    return c.permute(0, 2, 1, 3).reshape(out, inp)
