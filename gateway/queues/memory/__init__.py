"""The in-memory store: one process's queues (`store.MemoryQueue`), each model's bands, flows,
slots and counters in a `model_queue.ModelQueue`."""
