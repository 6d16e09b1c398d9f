"""Flat ranges of a tensor as boxes: how sharded checkpoint pieces are cut and read back.

A ZeRO shard owns a contiguous range ``[lo, hi)`` of a parameter's flattened (row-major) local
tensor; a tensor-parallel slice is a box of the global tensor. :func:`flat_boxes` cuts a flat
range into the few boxes it is made of (a partial first row, whole middle rows, a partial last
row, recursively), each of which is itself contiguous in flat order, so a piece of a 1-D shard
is ``shard[s - lo : e - lo].view(box shape)``. Pieces on disk are boxes of the global tensor,
which any other layout can intersect with the boxes it needs.

No communication; memory: none beyond the box lists.
"""

from __future__ import annotations

import math

Box = tuple[slice, ...]


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[Box, int, int]]:
    """Boxes covering the flat range ``[lo, hi)`` of a tensor of ``shape``: (box, start, end)
    with ``[start, end)`` the flat range the box occupies (contiguous)."""
    if lo >= hi:
        return []
    if not shape:
        return [((), lo, hi)]
    if len(shape) == 1:
        return [((slice(lo, hi),), lo, hi)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    out: list[tuple[Box, int, int]] = []
    r0, r_last = lo // inner, (hi - 1) // inner
    if r0 == r_last:  # inside one outer row: recurse into it
        base = r0 * inner
        for box, s, e in flat_boxes(shape[1:], lo - base, hi - base):
            out.append(((slice(r0, r0 + 1), *box), s + base, e + base))
        return out
    first_full = r0 if lo % inner == 0 else r0 + 1
    end_full = hi // inner
    if first_full > r0:  # partial head row
        out += flat_boxes(shape, lo, first_full * inner)
    if end_full > first_full:
        full = (slice(first_full, end_full), *(slice(0, n) for n in shape[1:]))
        out.append((full, first_full * inner, end_full * inner))
    if hi % inner:  # partial tail row
        out += flat_boxes(shape, end_full * inner, hi)
    return out


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes (None when empty)."""
    out = []
    for x, y in zip(a, b, strict=True):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def shift(box: Box, by: tuple[int, ...]) -> Box:
    """``box`` moved by ``by`` (negative to make it relative)."""
    return tuple(slice(s.start + d, s.stop + d) for s, d in zip(box, by, strict=True))


def volume(box: Box) -> int:
    return math.prod(s.stop - s.start for s in box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in box)


def to_json(box: Box) -> list[list[int]]:
    return [[s.start, s.stop] for s in box]


def from_json(data: list[list[int]]) -> Box:
    return tuple(slice(int(a), int(b)) for a, b in data)
