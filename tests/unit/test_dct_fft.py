"""The CPU's block DCT through a real FFT (kernels.dct.fft_dct_rows / fft_idct_rows)
against the float64 product of the DCT-II matrix, and where it is used."""
import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress.kernels import dct as D


def rows(m, block, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).laplace(size=(m, block))
                            .astype(np.float32))


def basis64(block):
    k, i = np.arange(block)[:, None], np.arange(block)[None, :]
    d = np.cos(np.pi * (2 * i + 1) * k / (2 * block)) * np.sqrt(2.0 / block)
    d[0] /= np.sqrt(2.0)
    return d


@pytest.mark.parametrize("block", D.BLOCKS)
def test_fft_dct_is_the_dct_ii_and_its_inverse(block):
    x = rows(37, block, block)
    want = x.double().numpy() @ basis64(block).T
    got = D.fft_dct_rows(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got.numpy(), want, atol=2e-6 * scale)
    back = D.fft_idct_rows(torch.from_numpy(want.astype(np.float32)))
    np.testing.assert_allclose(back.numpy(), x.numpy(), atol=2e-6 * scale)
    np.testing.assert_allclose(D.fft_idct_rows(got).numpy(), x.numpy(), atol=2e-6 * scale)
    # each coefficient alone: the inverse is the basis row (no mix-up of k and B - k)
    eye = torch.eye(block)
    np.testing.assert_allclose(D.fft_idct_rows(eye).numpy(), basis64(block), atol=1e-6)


def test_fft_dct_of_views_zeros_and_one_row():
    x = rows(8, 256, 3)
    np.testing.assert_allclose(D.fft_dct_rows(x[::2]).numpy(), D.fft_dct_rows(x)[::2].numpy())
    assert torch.equal(D.fft_dct_rows(torch.zeros(2, 128)), torch.zeros(2, 128))
    assert D.fft_dct_rows(torch.zeros(0, 256)).shape == (0, 256)
    assert torch.allclose(D.fft_idct_rows(D.fft_dct_rows(x[:1])), x[:1], atol=1e-5)


@pytest.mark.parametrize("block", D.BLOCKS)
def test_cpu_transform_takes_the_fft_from_its_crossover(block, monkeypatch):
    x = torch.from_numpy(np.random.default_rng(1).standard_normal(5 * block + 3)
                         .astype(np.float32))
    calls = []
    real = D.fft_dct_rows
    monkeypatch.setattr(D, "fft_dct_rows", lambda r, *a: calls.append(r.shape) or real(r, *a))
    coefs = D.dct(x, block, "torch")
    assert bool(calls) == (block >= D.FFT_FROM_BLOCK)
    np.testing.assert_allclose(coefs.numpy(), D.dct_reference(x, block).numpy(), atol=1e-5)
    back = D.idct_segments(coefs, (x.numel(),), block, "torch")
    np.testing.assert_allclose(back.numpy(), x.numpy(), atol=1e-5)


def test_dct_compressor_round_trip_on_the_cpu_path():
    """density=1 with 16-bit values: the whole compressor (transform, selection, values,
    inverse, error feedback's own decode) gives the gradient back."""
    g = torch.from_numpy(np.random.default_rng(4).standard_normal(3000).astype(np.float32))
    c = hvd_compress.from_spec("dct:density=1,bits=16,ef=0,block=256")
    payload, ctx = c.compress(g, "g")
    out = c.decompress(payload, ctx)
    assert float((out - g).norm() / g.norm()) < 1e-3


@pytest.mark.parametrize("block", [64, 256])
def test_cpu_transforms_after_inference_mode_and_on_tensors_that_require_grad(block):
    """A first call under torch.inference_mode() must not leave a per-thread buffer that
    later calls cannot write; inputs that require a gradient are transformed as before
    (the out= paths refuse them unless detached).  Run in a new thread: its own buffers."""
    import threading
    x = torch.from_numpy(np.random.default_rng(5).standard_normal(3 * block + 5)
                         .astype(np.float32))
    want = D.dct_reference(x, block)
    got, errors = [], []

    def work():
        try:
            with torch.inference_mode():
                got.append(D.dct(x, block, "torch"))
            got.append(D.dct(x, block, "torch"))
            got.append(D.dct_segments(x.clone().requires_grad_(), (x.numel(),), block, "torch"))
            got.append(D.idct_segments(want.clone().requires_grad_(), (x.numel(),), block,
                                       "torch"))
        except Exception as e:          # noqa: BLE001 (reported below)
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    for coefs in got[:3]:
        np.testing.assert_allclose(coefs.detach().numpy(), want.numpy(), atol=1e-5)
    np.testing.assert_allclose(got[3].numpy(), x.numpy(), atol=1e-5)
