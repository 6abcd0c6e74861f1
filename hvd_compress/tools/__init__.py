"""Tools beside the library proper: :mod:`.shaped_link` runs commands on loopback shaped
to a rate, or on two "hosts" joined by a shaped link (network namespaces and ``tc``), for
the benchmarks and the tests.  Nothing in the library imports this package."""
