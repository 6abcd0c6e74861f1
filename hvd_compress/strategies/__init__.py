"""Strategies: which compressor sends which gradient.  :mod:`.policy`: fixed per
parameter (``Policy``, ``Hylo.from_model``, seed 004); :mod:`.auto`: per bucket, chosen
from measured compute, codec and link times.  Both are compressors to the glue (a spec
string or object passed as ``compression=``); only the exchange driver calls into auto.

Imports: core and algorithms (``compressors``, ``memory``, ``spec``, ``buckets``,
``log``); no framework, no glue.
"""
