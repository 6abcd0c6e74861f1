"""Independent references: what a compressor must produce, computed from scratch in numpy
without hvd_compress (torch only to round to bfloat16)."""
import math

import numpy as np


def topk_mask(g, density):
    """The k largest |g| (k = ceil(density n)), ties broken by lowest index."""
    flat = g.reshape(-1)
    k = max(1, min(flat.size, math.ceil(density * flat.size)))
    mask = np.zeros(flat.size, bool)
    mask[np.argsort(-np.abs(flat), kind="stable")[:k]] = True
    return mask.reshape(g.shape)


def split_sizes(flat, sizes):
    """``flat`` cut into ``{name: part}`` by ``sizes`` (``{name: numel}``, in order)."""
    out, at = {}, 0
    for name, n in sizes.items():
        out[name] = flat[at:at + n]
        at += n
    return out


def compressed_update_rule(ranks, steps, sizes, density, residual_order=None, min_size=0,
                           key="trace", decay=None):
    """The compressed-update rule (hvd_compress/torch/compressed_update.py) with top-k,
    from what each rank recorded: ``trace/<t>/start`` (the weights, the same on every
    rank) and ``trace/<t>/update`` (what a plain optimizer on this rank's gradient made
    of them).  u_i = the update; c_i = u_i + e_i; s_i = topk(c_i) per tensor (``sizes``:
    ``{name: numel}`` in the flat order); e_i = c_i - s_i; p = start + mean(s_i).
    Tensors of fewer than ``min_size`` values are sent whole (no residual: zeros);
    ``decay``: ``ef_decay=`` (e_i = decay (c_i - s_i)); default, a top-k's default for
    updates, ``max(0.9, 1 - 10 density)``.  Returns ``{t: (p, [e_i with its tensors in residual_order (default sizes')])}``;
    ``key``: the recorded trace's prefix."""
    decay = max(0.9, 1.0 - 10.0 * density) if decay is None else decay
    e = [np.zeros_like(ranks[0][f"{key}/1/start"]) for _ in ranks]
    expected = {}
    for t in range(1, steps + 1):
        sent = []
        for i, r in enumerate(ranks):
            parts = split_sizes(r[f"{key}/{t}/update"] + e[i], sizes)
            s = np.concatenate([parts[n] if sizes[n] < min_size else
                                np.where(topk_mask(parts[n], density), parts[n], 0)
                                for n in sizes])
            e[i] = decay * (np.concatenate([parts[n] for n in sizes]) - s)
            sent.append(s)
        param = ranks[0][f"{key}/{t}/start"] + sum(sent) / len(ranks)
        residual = [np.concatenate([split_sizes(x, sizes)[n]
                                    for n in (residual_order or sizes)
                                    if sizes[n] >= min_size]) for x in e]
        expected[t] = param, residual
    return expected


def to_bf16(g):
    import torch
    return torch.from_numpy(np.ascontiguousarray(g, dtype=np.float32)).bfloat16().float().numpy()


def rangefloat_reference(x, bits, e=None):
    """Range-based float quantization in numpy (frexp arithmetic, not bit tricks)."""
    e = e or {4: 2, 6: 3, 8: 4, 12: 5, 16: 5}[bits]
    m = bits - 1 - e
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    if not a.size or a.max() == 0:
        return np.zeros_like(x, np.float32)
    big = np.frexp(a.max())[1] - 1                       # exponent of max|x|
    mant, ex = np.frexp(a)                               # a = mant 2^ex, mant in [0.5, 1)
    ex = ex - 1                                          # a = (2 mant) 2^ex
    q = np.floor((2 * mant - 1) * 2**m + 0.5)            # round half up
    ex, q = np.where(q == 2**m, ex + 1, ex), np.where(q == 2**m, 0, q)
    over = ex > big
    ex, q = np.where(over, big, ex), np.where(over, 2**m - 1, q)
    value = (1 + q / 2**m) * np.exp2(ex.astype(np.float64))
    value = np.where((a == 0) | (ex < big - 2**e + 2) | (a < 2.0**-126), 0, value)
    return (np.sign(x) * value).astype(np.float32)


def powersgd_reference(grads, rank, name, seed=0, min_compression_rate=2):
    """The sum over ranks after PowerSGD's first step, from scratch in numpy:
    ``P^ = orth(sum_w M_w Q0)``, ``out = P^ P^T sum_w M_w`` (vectors and matrices too
    small to shrink: the plain sum)."""
    import zlib
    total = sum(g.astype(np.float64) for g in grads)
    if grads[0].ndim < 2:
        return total
    rows, cols = grads[0].shape[0], grads[0].size // grads[0].shape[0]
    r = min(rank, rows, cols)
    if not (rows + cols) * r * min_compression_rate < rows * cols:
        return total
    q0 = np.random.RandomState(zlib.crc32(f"{seed}/{name}".encode())).standard_normal(
        (cols, r)).astype(np.float32)
    p, _ = np.linalg.qr(sum(g.reshape(rows, cols).astype(np.float64) @ q0 for g in grads))
    return (p @ p.T @ total.reshape(rows, cols)).reshape(grads[0].shape)


def reference_contribution(spec, g):
    """What one rank's gradient ``g`` contributes to the sum, computed without hvd_compress."""
    name, _, params = spec.partition(":")
    kv = dict(p.split("=") for p in params.split(",") if p)
    if kv.get("values", "float").startswith("rangefloat"):     # sparsifier's value codec
        plain = reference_contribution(spec.replace(f",values={kv['values']}", ""), g)
        kept = plain != 0
        out = np.zeros_like(plain)
        out[kept] = rangefloat_reference(plain[kept], int(kv["values"][10:]))
        return out
    if name == "none":
        return g
    if name == "fp16":
        return g.astype(np.float16).astype(np.float32)
    if name == "bf16":
        return to_bf16(g)
    if name == "laplace_topk":
        assert kv.get("exact") == "1", "only exact=1 has a unique reference"
        return np.where(topk_mask(g, float(kv["density"])), g, 0)
    if name == "rangefloat":
        return rangefloat_reference(g, int(kv.get("bits", 8)))
    if name == "twobit":                   # adaptive threshold t = mean|g|, first step
        t = float(kv["threshold"]) if "threshold" in kv else np.abs(g).astype(np.float64).mean()
        t = np.float32(t)
        return np.where(g >= t, t, np.where(g <= -t, -t, 0)).astype(np.float32)
    if name == "kernel_select":            # torch layout (out, in, *k) unless layout=keras
        keras = kv.get("layout") == "keras"
        ksize = int(np.prod(g.shape[:-2] if keras else g.shape[2:]))
        rows = g.reshape(ksize, -1).T if keras else g.reshape(-1, ksize)
        m = max(1, math.ceil(float(kv["fraction"]) * rows.shape[0]))
        keep = np.argsort(-np.linalg.norm(rows, axis=1), kind="stable")[:m]
        out = np.zeros_like(rows)
        out[keep] = rows[keep]
        return (out.T.reshape(g.shape) if keras else out.reshape(g.shape))
    if name == "signsgd":                  # first step: (||g||_1 / d) sign(g)
        a = np.abs(g.astype(np.float64)).sum() / g.size
        return np.where(g >= 0, a, -a).astype(np.float32)
    if name == "onebit":                   # first step: each side's mean
        pos, neg = g[g >= 0].astype(np.float64), g[g < 0].astype(np.float64)
        return np.where(g >= 0, pos.mean() if pos.size else 0.0,
                        neg.mean() if neg.size else 0.0).astype(np.float32)
    if name == "topk":
        return np.where(topk_mask(g, float(kv["density"])), g, 0)
    if name == "threshold":
        return np.where(np.abs(g) > float(kv["threshold"]), g, 0)
    raise KeyError(name)


MAX = 2 ** 31 - 1   #: int32 fixed point of coded SGD


def fixed_reference(parts, value_range=10.0):
    """Independent numpy: the int64 sum of the parts' int32 fixed point, decoded."""
    q = np.round(np.clip(np.asarray(parts, np.float64), -value_range, value_range)
                 * (MAX / value_range)).astype(np.int64)
    return (q.sum(0).astype(np.float64) * (value_range / MAX)).astype(np.float32)


def hier_pieces(names, offsets, numels, total, parts):
    """The hierarchical exchange's shards, independent of the library: ``[(shard, name,
    lo, hi)]`` of a flat bucket cut as Horovod's reduce-scatter cuts it (shard l has
    ``total // parts + (l < total % parts)`` values); a tensor cut by a boundary is the
    piece ``<name>/shard<l>``."""
    sizes = [total // parts + (i < total % parts) for i in range(parts)]
    bounds = np.cumsum([0] + sizes)
    out = []
    for l in range(parts):
        for name, o, m in zip(names, offsets, numels):
            lo, hi = max(bounds[l], o), min(bounds[l + 1], o + m)
            if hi > lo:
                whole = (lo, hi) == (o, o + m)
                out.append((l, name if whole else f"{name}/shard{l}", lo, hi))
    return out


def hier_reference(grads, hosts, pieces, contribution, residual=None):
    """One step of the hierarchical scheme in numpy: ``grads[r]`` is worker r's flat
    bucket (rank r = h L + l on host h), ``pieces`` from :func:`hier_pieces`,
    ``contribution(c)`` what a compressor sends of ``c``.  Host sums, per piece and host
    ``c = host sum + residual``, ``residual <- c - sent``, the cross-host sum of what was
    sent.  Returns the aggregate (a sum over all workers); ``residual`` (a dict keyed
    ``(host, piece name)``) is updated in place.  One host: the dense sum."""
    residual = {} if residual is None else residual
    size = len(grads)
    L = size // hosts
    host = [grads[h * L] + sum(grads[h * L + l] for l in range(1, L)) if L > 1
            else grads[h * L] for h in range(hosts)]
    if hosts == 1:
        return host[0]
    out = np.zeros_like(grads[0])
    for _, name, lo, hi in pieces:
        for h in range(hosts):
            c = host[h][lo:hi] + residual.get((h, name), 0)
            sent = contribution(c)
            residual[(h, name)] = c - sent
            out[lo:hi] += sent
    return out
