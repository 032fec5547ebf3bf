"""The in-memory store: one process's queues (`store.MemoryQueue`), each model's bands, slots and
counters in a `model_queue.ModelQueue`, each band's flows and fair-queuing clock in a
`band_queue.BandQueue`."""
