"""hvd_compress.hosts: the hosts' process sets of the hierarchical exchange, from the
places Horovod gives each worker (no Horovod job here: tests/integration/
test_hier_horovod.py runs them through horovodrun)."""
import pytest

from hvd_compress.hosts import host_groups, process_sets


def rows(hosts):
    """horovodrun's places for hosts of these sizes (ranks host by host)."""
    out = []
    for h, n in enumerate(hosts):
        for lr in range(n):
            cross = [i for i, m in enumerate(hosts) if m > lr]
            out.append((lr, n, cross.index(h), len(cross)))
    return out


def test_two_hosts_of_three():
    local, cross = host_groups(rows([3, 3]))
    assert local == [(0, 1, 2), (3, 4, 5)]
    assert cross == [(0, 3), (1, 4), (2, 5)]


@pytest.mark.parametrize("hosts,local,cross", [([1, 1, 1], [(0,), (1,), (2,)], [(0, 1, 2)]),
                                               ([4], [(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)])])
def test_one_worker_per_host_and_one_host(hosts, local, cross):
    assert host_groups(rows(hosts)) == (local, cross)


@pytest.mark.parametrize("hosts", [[2, 1], [1, 2], [3, 2, 1]])
def test_uneven_hosts_name_every_rank(hosts):
    with pytest.raises(ValueError, match="uneven hosts") as e:
        host_groups(rows(hosts))
    assert f"rank {sum(hosts) - 1}: {hosts[-1]}" in str(e.value)


def test_clashing_places_are_an_error():
    bad = rows([2, 2])
    bad[3] = bad[2]
    with pytest.raises(ValueError, match="not H hosts x L workers"):
        host_groups(bad)


def test_static_process_sets_for_hvd_init():
    sets = process_sets(size=8, local_size=4)
    assert [s.ranks for s in sets] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 4], [1, 5], [2, 6],
                                       [3, 7]]
    assert process_sets(size=4, local_size=4) == []          # one host: the global set
    with pytest.raises(ValueError, match="local_size=3"):
        process_sets(size=8, local_size=3)
