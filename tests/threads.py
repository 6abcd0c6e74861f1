"""Ranks as threads of one process (the in-process World, shared-memory files): each
rank runs ``fn(rank)``; what it returned or raised comes back per rank."""
import threading


def run_ranks(size, fn, timeout=120):
    """``(results, errors)``, one entry per rank (None where there is none), after every
    thread ``fn(rank)`` ended or ``timeout`` seconds passed for it."""
    out, errors = [None] * size, [None] * size

    def target(r):
        try:
            out[r] = fn(r)
        except BaseException as e:       # noqa: BLE001 - returned to the test
            errors[r] = e

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out, errors
