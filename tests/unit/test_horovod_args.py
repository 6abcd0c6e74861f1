"""hvd_compress.horovod_args: Horovod's optimizer arguments checked once for every glue
(no framework, no Horovod: a stand-in for Horovod's op constants)."""
from types import SimpleNamespace

import pytest

from hvd_compress import horovod_args as ha

HVD = SimpleNamespace(Average=0, Sum=1, Adasum=2)


class T:
    """A stand-in tensor."""

    def __init__(self, n):
        self.shape = (n,)


def is_t(x):
    return isinstance(x, T)


@pytest.mark.parametrize("glue,where", [("torch", "horovod.torch"),
                                        ("tensorflow", "DistributedGradientTape"),
                                        ("keras", "Keras")])
def test_adasum_names_op_and_where_to_get_it(glue, where):
    with pytest.raises(ValueError, match="op=hvd.Adasum") as err:
        ha.check_op(HVD.Adasum, HVD, glue)
    assert where in str(err.value)
    assert ha.check_op(HVD.Sum, HVD, glue) == HVD.Sum
    with pytest.raises(ValueError, match="op must be"):
        ha.check_op(5, HVD, glue)


def test_predivide_factor():
    assert ha.predivide_factor(4, HVD.Average, HVD) == 4.0
    assert ha.predivide_factor(1.0, HVD.Sum, HVD) == 1.0
    for bad in (0, -1, float("inf"), float("nan"), "x", None):
        with pytest.raises(ValueError, match="gradient_predivide_factor"):
            ha.predivide_factor(bad, HVD.Average, HVD)
    with pytest.raises(ValueError, match="hvd.Sum"):
        ha.predivide_factor(2.0, HVD.Sum, HVD)


def test_groups_from():
    a, b = T(3), T(4)
    assert ha.groups_from(0, None, None, is_t, "T") is None
    assert ha.groups_from(3, None, None, is_t, "T") == 3
    assert ha.groups_from(3, 2, None, is_t, "T") == 2          # groups wins, as Horovod
    assert ha.groups_from(0, ([a], (b,)), None, is_t, "T") == [[a], [b]]
    cases = [((-1, None, None), "num_groups"), ((True, None, None), "num_groups"),
             ((0, "x", None), "groups should"), ((0, 0, None), "groups should"),
             ((0, [a], None), "list of lists of T"), ((0, [[1]], None), "consist of T"),
             ((0, [[a], [a]], None), "once"), ((0, 2, 25), "bucket_mb")]
    for args, words in cases:
        with pytest.raises(ValueError, match=words):
            ha.groups_from(*args, is_t, "T")


def test_plan_groups_int_and_lists():
    c, d = SimpleNamespace(segmented=True), SimpleNamespace(segmented=True)
    params = [T(n) for n in (3, 4, 5, 6, 7)]
    entries = [(f"p{i}", p.shape, c, "float32", 4) for i, p in enumerate(params)]
    # split_list: 3 + 2, in launch order
    assert ha.plan_groups(2, params, entries) == [[4, 3], [2, 1, 0]]
    plan = ha.plan_groups([[params[0], params[4]], [params[2]]], params, entries)
    assert sorted(map(sorted, plan)) == [[0, 4], [1], [2], [3]]
    assert ha.describe_groups(2, [[4, 3], [2, 1, 0]]) == "groups=2 buckets=[2;3]"
    # a group of two compressors is cut where buckets.plan cuts
    mixed = [(f"p{i}", p.shape, c if i else d, "float32", 4) for i, p in enumerate(params)]
    assert sorted(map(sorted, ha.plan_groups([params[:2]], params, mixed))) == \
        [[0], [1], [2], [3], [4]]


def test_passes_and_devices():
    assert ha.passes(3) == 3
    for bad in (0, -2, 1.5, True, "2", None):
        with pytest.raises(ValueError, match="backward_passes_per_step"):
            ha.passes(bad)
    assert ha.check_device("", "device_dense") == ""

    def parse(text):
        if ":" in text and not text.startswith("/"):
            raise ValueError("unknown attribute")
    assert ha.check_device("/gpu:0", "device_dense", parse) == "/gpu:0"
    with pytest.raises(ValueError, match="device_sparse.*keyword"):
        ha.check_device("topk:density=0.01", "device_sparse", parse)
    with pytest.raises(ValueError, match="device_dense"):
        ha.check_device(object(), "device_dense")
