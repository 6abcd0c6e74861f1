"""Range-based float codes of many *segments* at once (kernel family ``rangefloat`` over a
bucket): segment ``s`` holds ``counts[s]`` consecutive values with its own exponent
range ``E_s`` -- a bucket's tensors on the sending side, every rank's tensors of the
gathered payloads on the receiving side -- in a fixed number of launches whatever the
number of segments.

The bytes are exactly those of :func:`.rangefloat.encode` applied to each segment alone,
end to end (each segment's codes padded to whole groups), with the exponent of
:func:`.rangefloat.max_exponent`, so the payload of
:class:`~hvd_compress.compressors.rangefloat.RangeFloatCodec` does not change:

- ``segment_max_exponent(x, counts)``: ``E_s`` per segment.  The float32 exponent field
  ``(bits >> 23) & 0xFF`` does not decrease with ``|x|``, so its maximum over a segment
  is the field of ``max|x|``: ``E = field - 127`` (``255``, NaN/Inf, gives ``E = 128``;
  zeros, subnormals and an empty segment ``-127``), one int32 atomic max per block into
  E's that start at ``-127`` (exact, deterministic).
- ``encode_segments(x, counts, e, m)``: that pass, then one encode launch; each program
  codes a block of one segment with that segment's ``E`` and writes its groups at the
  segment's group offset.  Returns the bytes and the ``[E, count]`` headers.
- ``decode_segments(data, emax, counts, e, m)``: one launch; each program decodes the
  groups of one block of one segment with its ``E`` and writes the values unpadded,
  segments end to end.  The headers are checked on the device and read back in one
  host synchronisation with the sizes (none where the counts are known on the host, or
  the total and the check is deferred: reads and writes stay in bounds whatever the
  headers say).
- ``decode_sum(data, emax, lengths, ranks, e, m)``: a dense payload's aggregate, every
  rank holding the same segments of host ``lengths``: the same launch, each program
  decoding its block in every rank's payload and summing in rank order, one write.

The same two kernels code a single tensor for :mod:`.rangefloat` (its ``encode`` and
``decode`` on CUDA): with ``TABLE=False`` program ``i`` takes values ``[i * block,
(i + 1) * block)`` of one segment, and decoding may take an exponent per group.

Tables: programs walk blocks of ``block`` values (a multiple of every group size) that
never straddle two segments.  Counts known on the host (a bucket's layout): the table of
:func:`.segmented.block_table`, built once per layout.  Counts on the device (a
sparse selection's per-tensor counts, or the gathered headers): computed there in two
launches (:func:`.segmented.device_blocks`: a scan program, then a binary search per
block; some 23 torch ops elsewhere) over an upper bound of ``ceil(n / block) +
segments`` blocks (the surplus blocks are empty).

Imports: the standard library, numpy, torch; on first use, Triton; and modules of its
own package.
"""
import functools
from typing import NamedTuple

import numpy as np
import torch

from ._backend import count_launch, pick_backend
from ._held import used
from ._launch import cached
from .rangefloat import decode_reference, encode_reference, group, max_exponent


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernels (once, on first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _exponent_kernel(x_ptr, add_ptr, src_ptr, starts_ptr, stops_ptr, segs_ptr, emax_ptr,
                         BLOCK: tl.constexpr, ADD: tl.constexpr):
        # ADD (float32 x): src + add written into x first (error feedback's c = g + r;
        # src is x, or a tensor alone's gradient when x is its spare buffer); else src is x
        pid = tl.program_id(0)
        start = tl.load(starts_ptr + pid)
        stop = tl.load(stops_ptr + pid)
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(src_ptr + offs, mask=offs < stop, other=0.0).to(tl.float32)
        if ADD:
            x = x + tl.load(add_ptr + offs, mask=offs < stop, other=0.0)
            tl.store(x_ptr + offs, x, mask=offs < stop)
        field = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
        # E = field - 127 (255, NaN/Inf, gives 128), maxed into E's of -127 (an empty
        # segment's): a signed int32 atomic max
        tl.atomic_max(emax_ptr + tl.load(segs_ptr + pid), tl.max(field, axis=0) - 127,
                      mask=start < stop, sem="relaxed")

    @triton.jit
    def _encode_kernel(x_ptr, starts_ptr, stops_ptr, segs_ptr, vstart_ptr, gstart_ptr, emax_ptr,
                       out_ptr, dec_ptr, n, E_BITS: tl.constexpr, M_BITS: tl.constexpr,
                       G: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                       TABLE: tl.constexpr, DECODED: tl.constexpr, MINUS: tl.constexpr):
        # TABLE: the block of a segment from the table; else one segment of n values.
        # DECODED: also write each value as _decode_kernel decodes its code into dec_ptr
        # (which may be x_ptr: every entry is read before the same program writes it);
        # MINUS: write x minus that instead (error feedback's residual)
        pid = tl.program_id(0)
        if TABLE:
            start = tl.load(starts_ptr + pid)
            stop = tl.load(stops_ptr + pid)
            s = tl.load(segs_ptr + pid)
            first = tl.load(gstart_ptr + s) + (start - tl.load(vstart_ptr + s)) // G
        else:
            start = pid.to(tl.int64) * BLOCK
            stop = n
            s = 0
            first = start // G
        GROUPS: tl.constexpr = BLOCK // G
        grp = tl.arange(0, GROUPS)
        lane = tl.arange(0, G)
        idx = start + grp[:, None] * G + lane[None, :]
        x = tl.load(x_ptr + idx, mask=idx < stop, other=0.0).to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        sign = (bits >> 31) & 1
        expf = (bits >> 23) & 0xFF
        mant = bits & 0x7FFFFF
        shift: tl.constexpr = 23 - M_BITS
        q = (mant + (1 << (shift - 1))) >> shift
        carry = q >> M_BITS
        q = q & ((1 << M_BITS) - 1)
        q = tl.where((expf == 255) & (mant != 0), (1 << M_BITS) - 1, q)      # NaN stays NaN
        c = tl.load(emax_ptr + s) - (expf - 127 + carry) + 1
        q = tl.where(c < 1, (1 << M_BITS) - 1, q)
        c = tl.where(c < 1, 1, c)
        zero = (expf == 0) | (c > (1 << E_BITS) - 1)
        code = tl.where(zero, 0, (sign << (E_BITS + M_BITS)) | (c << M_BITS) | q).to(tl.int64)
        if DECODED:                                  # _decode_kernel's arithmetic on the code
            back = (sign << 31) | ((tl.load(emax_ptr + s) - c + 1 + 127) << 23) \
                | (q << (23 - M_BITS))
            back = tl.where(zero, 0.0, back.to(tl.float32, bitcast=True))
            if MINUS:
                back = x - back
            tl.store(dec_ptr + idx, back, mask=idx < stop)
        word = tl.sum(code << ((E_BITS + M_BITS + 1) * lane[None, :]).to(tl.int64), axis=1)
        byte = tl.arange(0, 4)
        out = ((word[:, None] >> (8 * byte[None, :]).to(tl.int64)) & 0xFF).to(tl.uint8)
        at = first + grp                                                   # out group
        tl.store(out_ptr + at[:, None] * NB + byte[None, :], out,
                 mask=((start + grp * G) < stop)[:, None] & (byte < NB)[None, :])

    @triton.jit
    def _decode_kernel(in_ptr, starts_ptr, stops_ptr, segs_ptr, vstart_ptr, gstart_ptr, emax_ptr,
                       e_stride, out_ptr, n, rank_bytes, segments, E_BITS: tl.constexpr,
                       M_BITS: tl.constexpr, G: tl.constexpr, NB: tl.constexpr,
                       BLOCK: tl.constexpr, TABLE: tl.constexpr, PER_GROUP: tl.constexpr,
                       RANKS: tl.constexpr):
        # TABLE: as in _encode_kernel; PER_GROUP (without TABLE): an exponent per group;
        # RANKS > 1 (with TABLE): the sum, in rank order from 0.0, of RANKS payloads of the
        # same segments, rank r's bytes rank_bytes further on and its exponents `segments`.
        # A segment's exponent is e_stride int32 from the last (a header's column: 2).
        # Reads stay in a rank's rank_bytes and writes in out's n values whatever the
        # table says: a malformed payload's headers, checked on the device and read
        # back later (ops.deferred_checks), decode garbage but never out of bounds
        pid = tl.program_id(0)
        if TABLE:
            start = tl.load(starts_ptr + pid)
            stop = tl.load(stops_ptr + pid)
            s = tl.load(segs_ptr + pid)
            first = tl.load(gstart_ptr + s) + (start - tl.load(vstart_ptr + s)) // G
        else:
            start = pid.to(tl.int64) * BLOCK
            stop = n
            s = 0
            first = start // G
        GROUPS: tl.constexpr = BLOCK // G
        grp = tl.arange(0, GROUPS)
        byte = tl.arange(0, 4)
        at = first + grp                                                   # in group
        ok = ((start + grp * G) < stop) & (at >= 0) & (at < rank_bytes // NB)
        lane = tl.arange(0, G)
        B: tl.constexpr = E_BITS + M_BITS + 1
        acc = tl.zeros([GROUPS, G], dtype=tl.float32)
        in_at = in_ptr + at[:, None] * NB + byte[None, :]        # rank 0's; then one further
        emax_at = emax_ptr + s * e_stride
        for _ in range(RANKS):                                  # (pointers: no int32 product)
            raw = tl.load(in_at, mask=ok[:, None] & (byte < NB)[None, :], other=0).to(tl.int64)
            word = tl.sum(raw << (8 * byte[None, :]).to(tl.int64), axis=1)
            code = ((word[:, None] >> (B * lane[None, :]).to(tl.int64))
                    & ((1 << B) - 1)).to(tl.int32)
            sign = (code >> (E_BITS + M_BITS)) & 1
            c = (code >> M_BITS) & ((1 << E_BITS) - 1)
            q = code & ((1 << M_BITS) - 1)
            if PER_GROUP:
                emax = tl.load(emax_ptr + at, mask=ok, other=0)[:, None]
            else:
                emax = tl.load(emax_at)
            expf = emax - c + 1 + 127
            bits = (sign << 31) | (expf << 23) | (q << (23 - M_BITS))
            acc += tl.where(c == 0, 0.0, bits.to(tl.float32, bitcast=True))   # never -0.0
            in_at += rank_bytes
            emax_at += segments * e_stride
        idx = start + grp[:, None] * G + lane[None, :]
        tl.store(out_ptr + idx, acc, mask=(idx < stop) & (idx >= 0) & (idx < n))

    return triton, cached(_exponent_kernel), cached(_encode_kernel), cached(_decode_kernel)


BLOCK = 1024       #: values per program (a multiple of every group size: 1, 2 or 4)


class Table(NamedTuple):
    """Blocks of segments end to end that never straddle two segments (int64, device)."""
    starts: torch.Tensor     #: first value of each block
    stops: torch.Tensor      #: end of the block's segment (the block stops there or earlier)
    segs: torch.Tensor       #: the segment of each block
    vstart: torch.Tensor     #: first value of each segment
    gstart: torch.Tensor     #: first group of each segment in the packed bytes


_HOST_TABLES = {}


class HostTable(NamedTuple):
    """A :class:`Table` of segments whose lengths the host knows, with its sizes."""
    table: Table
    groups: int              #: groups of all segments
    values: int              #: values of all segments
    counts: torch.Tensor     #: int32 lengths, on the device (the headers' counts)


def host_table(lengths, g, device, block=BLOCK):
    """:class:`HostTable` of segments of host ``lengths`` (cached per lengths, group
    size, block and device: a bucket's table is copied there once)."""
    key = (tuple(int(v) for v in lengths), g, block, str(device))
    got = _HOST_TABLES.get(key)
    if got is None:
        from .segmented import block_table
        if len(_HOST_TABLES) > 256:
            _HOST_TABLES.clear()
        lengths = np.asarray(key[0], dtype=np.int64)
        groups = -(-lengths // g)
        blocks = block_table(key[0], device, block)
        as_t = lambda v, t=torch.int64: torch.as_tensor(v, dtype=t, device=device)  # noqa: E731
        table = Table(blocks.starts, blocks.stops, blocks.segs,
                      as_t(np.cumsum(lengths) - lengths), as_t(np.cumsum(groups) - groups))
        got = _HOST_TABLES[key] = HostTable(table, int(groups.sum()), int(lengths.sum()),
                                            as_t(lengths, torch.int32))
    return used(got)                    # (a CUDA graph that reads it keeps it: _held)


def device_table(counts, n, g, block=BLOCK):
    """:class:`Table` and total groups (a 0-d device tensor) of segments of ``counts``
    (int64 on the device, ``>= 0``, summing to ``n``): no host synchronisation, two
    launches on CUDA (:func:`.segmented.device_blocks`); ``ceil(n / block) + len(counts)``
    blocks, the surplus empty."""
    from .segmented import device_blocks
    starts, stops, segs, vstart, gstart, groups = device_blocks(counts.reshape(-1), n, g, block)
    return Table(starts, stops, segs, vstart, gstart), groups


# -- the exponent of each segment -------------------------------------------------------

def segment_max_exponent_reference(x, counts):
    """int32 ``E`` of each segment: :func:`.rangefloat.max_exponent` of its values."""
    parts = torch.split(x.reshape(-1), [int(c) for c in counts])
    return torch.stack([max_exponent(p) for p in parts]).to(torch.int32)


def _exponents(x, table, segments, block, add=None, source=None):
    triton, kernel = _kernels()[:2]
    emax = torch.full((segments,), -127, dtype=torch.int32, device=x.device)
    count_launch("rangefloat_segment_exponent")
    kernel[(table.starts.numel(),)](x, x if add is None else add,
                                    x if source is None else source, table.starts,
                                    table.stops, table.segs, emax, BLOCK=block,
                                    ADD=add is not None)
    return emax


def segment_max_exponent(x, counts, backend=None, block=BLOCK):
    """int32 ``E`` of each segment of flat ``x`` (``counts``: a host sequence or an int64
    device tensor), one launch (kernel on CUDA)."""
    if pick_backend(x, backend) == "torch":
        return segment_max_exponent_reference(x, counts.tolist() if torch.is_tensor(counts)
                                              else counts)
    x = x.reshape(-1).contiguous()
    if len(counts) == 0:
        return torch.zeros(0, dtype=torch.int32, device=x.device)
    if torch.is_tensor(counts):
        table, _ = device_table(counts.to(x.device), x.numel(), 1, block)
    else:
        table = host_table(counts, 1, x.device, block).table
    return _exponents(x, table, table.vstart.numel(), block)


# -- encode: every segment's codes, end to end ------------------------------------------

def encode_segments_reference(x, counts, e, m):
    """``(bytes, int32 headers [E_0, count_0, E_1, ...])``: each segment encoded alone
    with :func:`.rangefloat.encode_reference`, end to end."""
    parts = torch.split(x.reshape(-1), [int(c) for c in counts])
    emax = [max_exponent(p) for p in parts]
    data = torch.cat([encode_reference(p, E, e, m) for p, E in zip(parts, emax)])
    header = torch.stack([torch.stack([E.to(torch.int32), torch.tensor(p.numel(),
                                       dtype=torch.int32, device=x.device)]) for p, E in
                          zip(parts, emax)])
    return data, header.reshape(-1)


def encode_segments(x, counts, e, m, lengths=None, backend=None, block=BLOCK, decoded=None,
                    minus=False, add=None, source=None):
    """:func:`encode_segments_reference` in two launches (kernels on CUDA): the exponent
    pass and the encode.  ``counts``: int64 device tensor of the segments' lengths, or
    None with ``lengths`` (host ints; then no op builds the table).  The byte count needs
    the groups on the host: no synchronisation where ``lengths`` are given or a group is
    one code (8 and 16 bits), else one.  ``decoded``: a float32 tensor of ``x``'s size
    (``x`` itself, if it is contiguous float32) that the encode also fills with what
    :func:`decode_segments` makes of the bytes, bit for bit but a NaN's payload, which
    CUDA's decode makes canonical (the sender's error feedback needs no decode: no table,
    no launch); with ``minus``, ``x`` minus that, in float32 (error feedback's residual,
    in the same pass).  ``add``: ``x + add`` is written over
    ``x`` by the exponent pass first, and encoded (error feedback's ``c = g + r``; both
    contiguous 1-D float32); with ``source`` (another such buffer), ``source + add`` is
    written into ``x``, which is not read before (a tensor alone's spare buffer)."""
    g, nb = group(1 + e + m)
    if decoded is not None and (decoded.dtype != torch.float32 or decoded.numel() != x.numel()
                                or not decoded.is_contiguous()):
        raise ValueError(f"decoded must be a contiguous float32 tensor of {x.numel()} values, "
                         f"got {decoded.dtype} of {decoded.numel()}")
    if add is not None or source is not None:
        from .segmented import add_into, check_addends
        check_addends("encode_segments", x, add, source)
    if pick_backend(x, backend) == "torch":
        if add is not None:
            add_into(x, add, source)
        lengths = counts.tolist() if lengths is None else lengths
        out = encode_segments_reference(x, lengths, e, m)
        if decoded is not None:
            back = decode_segments_reference(out[0], out[1][0::2], out[1][1::2], e, m)
            decoded.reshape(-1).copy_(x.reshape(-1).float() - back if minus else back)
        return out
    triton, _, kernel, _ = _kernels()
    x = x.reshape(-1).contiguous()
    if lengths is None and counts.numel() == 0:       # (no segment: no value to write)
        return (torch.zeros(0, dtype=torch.uint8, device=x.device),
                torch.zeros(0, dtype=torch.int32, device=x.device))
    if lengths is not None:
        known = host_table(lengths, g, x.device, block)
        table, total, counts = known.table, known.groups, known.counts
    else:
        table, total = device_table(counts, x.numel(), g, block)
        total = x.numel() if g == 1 else int(total)            # the one synchronisation
    segments = table.vstart.numel()
    emax = _exponents(x, table, segments, block, add, source)
    out = torch.empty(total * nb, dtype=torch.uint8, device=x.device)
    count_launch("rangefloat_encode_segments")
    kernel[(table.starts.numel(),)](x, table.starts, table.stops, table.segs, table.vstart,
                                    table.gstart, emax, out, x if decoded is None else decoded,
                                    0, E_BITS=e, M_BITS=m, G=g, NB=nb, BLOCK=block, TABLE=True,
                                    DECODED=decoded is not None, MINUS=bool(minus))
    return out, torch.stack([emax, counts.to(torch.int32)], 1).reshape(-1)


# -- decode: every segment's values, unpadded, end to end --------------------------------

def decode_segments_reference(data, emax, counts, e, m):
    """float32 values of every segment, unpadded, end to end (segment ``s``: ``counts[s]``
    codes padded to whole groups, exponent ``emax[s]``), by
    :func:`.rangefloat.decode_reference` segment by segment."""
    g, nb = group(1 + e + m)
    out, at = [], 0
    for E, count in zip(emax.tolist(), counts.tolist()):
        size = -(-count // g) * nb
        per_group = torch.full((size // nb,), E, dtype=torch.int32, device=data.device)
        out.append(decode_reference(data[at:at + size], per_group, e, m)[:count])
        at += size
    return torch.cat(out) if out else torch.zeros(0, device=data.device)


def check_headers(data, emax, counts, e, m, bounds=None):
    """``(values, expected bytes, bad, bounds)`` from one host synchronisation: ``bad``
    when a header holds an exponent outside [-127, 128] or a negative count; ``values``
    the total number of values; ``expected`` the bytes the headers describe; ``bounds``
    (two 0-d integer device tensors read back in the same synchronisation, for example
    the payload indices' ``(min, max)``) as a list of two ints, or None.  The numbers
    come from one launch where the kernels run (:func:`.header_check.header_stats`)."""
    from .header_check import header_stats
    g, nb = group(1 + e + m)
    values, expected, bad, lo, hi = header_stats(emax, counts, g, nb, bounds=bounds).tolist()
    return values, expected, bool(bad), ([lo, hi] if bounds is not None else None)


def decode_segments(data, emax, counts, e, m, total=None, lengths=None, backend=None,
                    block=BLOCK):
    """:func:`decode_segments_reference` in one launch (kernel on CUDA), for headers
    already checked (:func:`check_headers`): ``total`` values in all (host int), or the
    segments' host ``lengths`` (then no op builds the table)."""
    if pick_backend(data, backend) == "torch":
        return decode_segments_reference(data, emax, counts, e, m)
    triton, _, _, kernel = _kernels()
    g, nb = group(1 + e + m)
    if lengths is not None:
        known = host_table(lengths, g, data.device, block)
        table, total = known.table, known.values
    if total == 0:                                  # (no segment, or only empty ones)
        return torch.zeros(0, dtype=torch.float32, device=data.device)
    if lengths is None:
        table, _ = device_table(counts, total, g, block)
    out = torch.empty(total, dtype=torch.float32, device=data.device)
    count_launch("rangefloat_decode_segments")
    emax = _int32(emax)
    kernel[(table.starts.numel(),)](data.contiguous(), table.starts, table.stops, table.segs,
                                    table.vstart, table.gstart, emax, emax.stride(0), out, total,
                                    data.numel(), 0, E_BITS=e, M_BITS=m, G=g, NB=nb,
                                    BLOCK=block, TABLE=True, PER_GROUP=False, RANKS=1)
    return out


def _int32(emax):
    """``emax`` as the decode kernel reads it: 1-D int32, any stride (a header's column is
    read where it lies, no copy)."""
    emax = emax.reshape(-1)
    return emax if emax.dtype == torch.int32 else emax.to(torch.int32)


def decode_sum_reference(data, emax, lengths, ranks, e, m):
    """float32 ``sum_r values_r`` of ``ranks`` payloads end to end (``data``), each the
    segments of host ``lengths`` (rank ``r``'s exponents ``emax[r * T:(r + 1) * T]``),
    added in rank order from 0.0: a dense payload's aggregate."""
    lengths = [int(n) for n in lengths]
    values = decode_segments_reference(data, emax.reshape(-1), torch.tensor(
        lengths * ranks, dtype=torch.int64), e, m).reshape(ranks, -1)
    acc = torch.zeros(sum(lengths), dtype=torch.float32, device=data.device)
    for r in range(ranks):
        acc = acc + values[r]
    return acc


def decode_sum(data, emax, lengths, ranks, e, m, backend=None, block=BLOCK):
    """:func:`decode_sum_reference` in one launch (kernel on CUDA), for headers already
    checked against ``lengths`` (the same segments in every rank's payload): each value
    decoded and summed over the ranks in registers, one write of the sum, where decoding
    every rank's values and summing the rows wrote them all, read them and wrote the sum."""
    if pick_backend(data, backend) == "torch":
        return decode_sum_reference(data, emax, lengths, ranks, e, m)
    triton, _, _, kernel = _kernels()
    g, nb = group(1 + e + m)
    known = host_table(lengths, g, data.device, block)
    out = torch.empty(known.values, dtype=torch.float32, device=data.device)
    if known.values == 0 or ranks == 0:
        return out.zero_()
    table = known.table
    count_launch("rangefloat_decode_sum")
    emax = _int32(emax)
    kernel[(table.starts.numel(),)](data.contiguous(), table.starts, table.stops, table.segs,
                                    table.vstart, table.gstart, emax, emax.stride(0), out,
                                    known.values, known.groups * nb, len(known.table.vstart),
                                    E_BITS=e, M_BITS=m, G=g, NB=nb, BLOCK=block, TABLE=True,
                                    PER_GROUP=False, RANKS=int(ranks))
    return out
