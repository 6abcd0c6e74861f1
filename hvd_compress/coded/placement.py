"""Redundant placement of a mini-batch on the workers (CSSGD's algorithm 2).

With ``n`` workers and redundancy ``r`` the global mini-batch is cut into
``P = C(n, r)`` parts, one per r-subset of the workers, in the order of
``itertools.combinations(range(n), r)`` (the same on every rank).  Part ``q`` goes to
every worker of its subset, so each worker computes ``C(n−1, r−1)`` parts (``r/n`` of
the batch) and each part is computed on ``r`` workers.  The exchange groups are the
``C(n, r+1)`` (r+1)-subsets: in group ``S`` the part ``S∖{k}`` is held by every member
but ``k``.

Li, Xie, Mao, Xu, Zhu, Zhang, "Coded synchronous SGD" (seed 003), algorithm 2.

Imports: the standard library, numpy.
"""
from dataclasses import dataclass, field
from itertools import combinations
from math import comb

import numpy as np


def check_redundancy(n, r):
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 1 <= r <= n:
        raise ValueError(f"redundancy must be an integer in [1, n={n}] (n = number of "
                         f"workers), got {r!r}")
    return int(r)


@dataclass(frozen=True)
class Placement:
    """Which worker holds which part.  Build it with :func:`placement`."""
    n: int
    r: int
    parts: tuple = field(repr=False)     #: part q -> its sorted r-subset of workers
    groups: tuple = field(repr=False)    #: the sorted (r+1)-subsets, in a fixed order

    @property
    def num_parts(self):
        return len(self.parts)

    def part_of(self, workers):
        """The index of the part held by exactly the (sorted) r-subset ``workers``."""
        return self._index[tuple(workers)]

    def holds(self, worker, q):
        return worker in self.parts[q]

    def worker_parts(self, worker):
        """The parts ``worker`` computes (``C(n−1, r−1)`` of them), ascending."""
        return tuple(q for q, s in enumerate(self.parts) if worker in s)

    def worker_groups(self, worker):
        """The (r+1)-subsets ``worker`` belongs to (``C(n−1, r)`` of them), in order."""
        return tuple(g for g in self.groups if worker in g)

    def part_sizes(self, batch_size):
        """Samples per part for a global mini-batch of ``batch_size``: ``batch_size // P``
        each, the first ``batch_size % P`` parts one more."""
        P = self.num_parts
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < P:
            raise ValueError(f"batch_size must be an integer >= C(n={self.n}, r={self.r}) = "
                             f"{P} (one sample per part at least), got {batch_size!r}")
        base, extra = divmod(int(batch_size), P)
        return [base + (q < extra) for q in range(P)]

    def part_slices(self, batch_size):
        """``[(start, stop)]`` of each part in the global mini-batch."""
        ends = np.cumsum([0] + self.part_sizes(batch_size))
        return [(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:])]

    def worker_indices(self, worker, batch_size):
        """Positions in the global mini-batch of ``worker``'s parts, part after part, and
        the length of each of its parts (to cut what a loader returns back into parts)."""
        sl = self.part_slices(batch_size)
        mine = self.worker_parts(worker)
        idx = np.concatenate([np.arange(*sl[q]) for q in mine]).astype(np.int64)
        return idx, [sl[q][1] - sl[q][0] for q in mine]


def placement(n, r):
    """The placement of :class:`Placement` for ``n`` workers and redundancy ``r``."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n (number of workers) must be a positive integer, got {n!r}")
    r = check_redundancy(int(n), r)
    parts = tuple(combinations(range(n), r))
    groups = tuple(combinations(range(n), r + 1)) if r < n else ()
    p = Placement(int(n), r, parts, groups)
    object.__setattr__(p, "_index", {s: q for q, s in enumerate(parts)})
    assert len(parts) == comb(n, r) and len(groups) == comb(n, r + 1)
    return p


class CodedBatchSampler:
    """Global mini-batches cut into parts; yields this worker's samples of each.

    Every rank draws the same permutation of ``range(dataset_len)`` per epoch (from
    ``seed`` and the epoch, like ``DistributedSampler``), cuts it into global mini-batches
    of ``batch_size`` (the last incomplete one dropped) and yields, per mini-batch, the
    dataset indices of this worker's parts, part after part.  Usable as a PyTorch
    ``DataLoader(batch_sampler=...)`` or to index arrays in TensorFlow; ``part_lengths``
    cuts a loaded batch back into parts.
    """

    def __init__(self, dataset_len, batch_size, num_replicas, rank, redundancy, seed=0,
                 shuffle=True):
        self.placement = placement(num_replicas, redundancy)
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) \
                or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be an integer in [0, num_replicas={num_replicas}), "
                             f"got {rank!r}")
        self.placement.part_sizes(batch_size)                    # checks batch_size
        self.batch_size = int(batch_size)
        self.positions, self.part_lengths = self.placement.worker_indices(rank, batch_size)
        if dataset_len < batch_size:
            raise ValueError(f"dataset_len ({dataset_len}) is smaller than batch_size "
                             f"({batch_size})")
        self.dataset_len, self.seed, self.shuffle, self.epoch = dataset_len, seed, shuffle, 0

    def set_epoch(self, epoch):
        self.epoch = int(epoch)

    def __len__(self):
        return self.dataset_len // self.batch_size

    def __iter__(self):
        order = (np.random.default_rng([self.seed, self.epoch]).permutation(self.dataset_len)
                 if self.shuffle else np.arange(self.dataset_len))
        for b in range(len(self)):
            batch = order[b * self.batch_size:(b + 1) * self.batch_size]
            yield batch[self.positions].tolist()
