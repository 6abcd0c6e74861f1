"""Property-based: every decoder, given any malformed aggregate (tensors dropped or
added, truncated, extended, emptied, of another dtype, indices out of range), raises
ValueError or TypeError naming the compressor, never a raw framework error (see
tests/malformed.py; benchmarks/fuzz_payloads.py runs many more cases)."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from malformed import DTYPES, FREE_BITS, MUTATIONS, SPECS, TF, Torch, check, fuzz

CASES = st.tuples(st.sampled_from(SPECS), st.sampled_from(MUTATIONS), st.integers(0, 3),
                  st.integers(1, 9), st.sampled_from(DTYPES))


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_malformed_aggregates_raise_clear_errors(framework):
    fw = Torch() if framework == "torch" else TF()

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(CASES)
    def run(case):
        check(fw, *case)

    run()


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_fuzz_counts(framework):
    """600 random cases: no raw error (``check`` raises on one), every compressor raised
    clear errors, and only payloads with free bit patterns stayed well formed."""
    counts = fuzz(Torch() if framework == "torch" else TF(), 600)
    for spec in SPECS:
        assert counts[spec]["error"] > 0, (spec, counts[spec])
        assert counts[spec]["ok"] == 0 or spec in FREE_BITS, (spec, counts[spec])
    assert sum(c["error"] for c in counts.values()) > 400
