"""The engines: where a snapshot's spectra are computed, and when.

``protocol.make_engine`` chooses one (the only place that does): ``engine.SnapshotEngine`` (one
process, or one per rank with ``distributed``'s split of the shape groups), ``sharded.ShardedEngine``
(matrices sharded across ranks, ``shards``), each running ``compute.SpectrumCompute`` within
``budget``'s ledger, inline or on the worker thread as ``placement`` decides, on ``streams``' compute
stream on CUDA; ``partitioned`` gathers FSDP1 / ZeRO-3 parameters unit by unit for ``distributed``.
"""
