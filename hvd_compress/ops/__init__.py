"""Framework primitives that the compression algorithms are written on.

Every algorithm in :mod:`hvd_compress.compressors` is written once, against the small
set of functions below; :func:`ops_for` picks the PyTorch or the TensorFlow
implementation from the type of the tensor it is given.  Neither framework is imported
until a tensor of that framework is seen, so ``import hvd_compress`` needs neither.

The primitives (both modules define all of them, with the same meaning):

=====================  ===========================================================
``flatten(t)``          1-D view or copy of ``t`` (any layout, 0-d included)
``numel(t)``            static element count (python int)
``is_floating(t)``      floating-point dtype?
``all_finite(t)``       scalar boolean tensor: no NaN / Inf in ``t``
``abs(t)``              element-wise absolute value
``topk_indices(s, k)``  int32 indices of the ``k`` largest entries of 1-D ``s``
``where_indices(m)``    int32 indices where the 1-D boolean mask ``m`` is true
``arange(n)``           int32 0..n-1
``random_indices(n, k, seed, step)``  ``k`` distinct int32 indices, a pure
                        function of ``(seed, step)`` (same on every rank)
``random_indices_segments(numels, ks, seed, steps)``  the same for every tensor of a
                        bucket (PyTorch: a fixed number of ops)
``gather(t, idx)``      ``t[idx]``
``scatter_sum(n, idx, v, dtype, ordered, meeting, segments)``  zeros(n) with ``v``
                        summed in at ``idx``, an index's values in a fixed order
                        (PyTorch; ``segments``: rank by rank)
``summing_ranks(P, rows, equal)``  context: the decompresses inside sum P ranks'
                        payloads (at most P values meet at an index; PyTorch), each
                        rank's rows of each payload tensor where known
``rank_rows(part, n)``  those rows of the aggregate's tensor ``part`` (None: unknown)
``check_indices(idx, n, what)``    raise ValueError when an index is outside [0, n)
``index_check(idx, n, what)``     the same check, ``finish()``-ed later, which returns
                                  the indices to scatter (PyTorch: read back with a
                                  decode's own readback where there is one)
``deferred_checks(sink)``         context: index checks finished inside (and range-float
                                  header checks) wait in the list ``sink`` (PyTorch;
                                  the indices clamped meanwhile)
``settle_checks(sink)``           read them back at once, raise the first failure
``deferral_sink()``               the list checks go to now, or None (TensorFlow: None)
``cast(t, dtype)``; ``float32``, ``float16``, ``bfloat16``, ``int16``, ``int32``
``bitcast(t, dtype)``   reinterpret bits (same element size)
``cond(pred, f, g)``    ``f()`` if ``pred`` else ``g()`` (graph-safe in TF)
``select(pred, a, b)``  ``a`` if scalar ``pred`` else ``b``, element-wise shapes equal
``divide(a, b)``        ``a / b`` rounded as IEEE division on every device (CUDA divides
                        by a Python number as a multiplication by its reciprocal)
``size_bytes(t)``       bytes of ``t`` (python int in torch, int64 tensor in TF)
``new_store()``         a :class:`~hvd_compress.stores` state store for this framework
=====================  ===========================================================

Further groups, each with its docstrings in ``torch_ops/`` (where the Triton kernels
are dispatched) and mirrored in ``tf_ops/``, both split by family into the same modules
(``core``, ``selection``, ``segments``, ``codecs``): threshold selection (``abs_sum_max``,
``count_above``, ``compact_above``, the bit-space search helpers), 2-bit packing and
convolution kernels (``twobit_pack``, ``kernel_matrix``, ...), range-based float and
block DCT (``rangefloat_encode``, ``block_dct``, ...), and PowerSGD's low-rank products
(``matmul``, ``orthonormal_columns``, ``low_rank_products``,
``subtract_low_rank_products``: each product written in its place, no product tensors
on PyTorch); error feedback's buffers
(``supports_inplace``, ``add_into``, ``subtract``, ``subtract_at``, ``scale``: the
residual's decay, and ``restore_flagged``: the old residuals kept where device flags say
NaN/Inf, without reading them on the host); and the size cut-off
``small_topk_below``; buckets (``concat``, ``split``, ``split_cols``, ``segment_ids``,
``layout_constant`` (a bucket's per-tensor k, n, ...: made once per layout and device
in PyTorch), ``segment_abs_sum_max``, ``segment_count_above``, ``segment_compact_above``,
``segment_counts``, ``segment_sum_int``, ``rows_max``/``rows_min``, ``split_sizes``,
``host_all``, and the choice ``segmented_search``); laplace_topk's fused search
(``fused=1``: ``bucket_blocks``, ``search_start``,
``histogram_step``, ``band_select``, ``padded_slots``, and ``warm=1``'s
``warm_brackets``/``keep_brackets``/``warm_search_start``, all PyTorch only: TensorFlow's
``histogram_search_supported`` is False and they raise NotImplementedError there);
bucket codecs in one launch per pass (``bucket_codec_kernels``, ``twobit_pack_segments``,
``twobit_pack_fit``,
``twobit_decode_segments``, ``rangefloat_encode_segments``, ``rangefloat_decode_segments``,
``rangefloat_decode_sum``, ``onebit_pack_segments``, ``onebit_decode_segments``, and the
stochastic quantizers' ``uniform_segments`` and ``segment_sum``: PyTorch's Triton path,
and TensorFlow's one call a bucket for twobit (``bucket_codec_kernels(flat,
codec)`` names the codec); elsewhere they return None or raise, and the codecs go
tensor by tensor);
aggregation-aware exchange (``unique_sorted``, ``ones_like``).  ``twobit_decode_sum``,
``rangefloat_decode_ranks``, ``segment_abs_topk`` (each tensor's top-k of ``|x|`` and
the bucket's finiteness from one selection: CPU, and PyTorch CUDA for a bucket of
many tensors) and ``twobit_subtract_own``
(2-bit error feedback's residual without decoding: PyTorch CPU and the Triton path) are optional
fast paths: they return None where a framework or device has none, and the compressor's
generic code (written once) runs instead.
"""


def ops_for(tensor):
    """Return the primitives module for ``tensor``'s framework (torch or tensorflow)."""
    module = type(tensor).__module__
    if module.startswith("torch"):
        from . import torch_ops
        return torch_ops
    if module.startswith("tensorflow") or module.startswith("keras"):
        from . import tf_ops
        return tf_ops
    raise TypeError(
        f"hvd_compress works on torch.Tensor or tf.Tensor, got {type(tensor).__name__}")
