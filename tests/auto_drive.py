"""auto's schedule driven by hand, without collectives: a fake communicator and one step
of made-up timings (tests/unit/test_auto.py, tests/unit/test_auto_trials.py)."""


class FakeComm:
    rank = 0

    def __init__(self):
        self.calls = []

    def broadcast(self, values, name):
        self.calls.append((name, list(values)))
        return list(values)

    def allgather(self, values, name):
        self.calls.append((name, list(values)))
        return [list(values)]


def drive(auto, comm, times):
    """One step: ``times[key] = [(C, T, D) per candidate]``; reports what the candidate
    chosen for each bucket would take; returns the choice used."""
    used = {}
    for key, per in times.items():
        i, _ = auto.choose(key)
        used[key] = i
        auto.launched(key)
        c, t, d, *nbytes = per[i]
        auto.record(key, i, c, t, d, nbytes[0] if nbytes else 1000 * (i + 1))
    auto.backward_done()
    auto.end_step(comm)
    return used
