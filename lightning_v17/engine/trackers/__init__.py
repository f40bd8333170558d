"""Pure (Lightning-free) trackers behind the callbacks in ``lightning_v17.callbacks``.

One module per concern, each tested alone in tests/unit:

- :mod:`.loss_scale`: the dynamic loss-scale state machine and a ZeRO-shard-aware fp16 grad scaler.
- :mod:`.straggler`: windowed per-rank timing statistics (median / MAD) and patience-based flagging.
- :mod:`.throughput`: tokens/s, FLOP/s and MFU arithmetic, and the cached CPU matmul peak probe.
- :mod:`.memory`: storage-deduplicated byte counts of params, grads and optimizer state; RSS helpers.
"""
