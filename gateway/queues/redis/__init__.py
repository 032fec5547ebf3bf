"""The Redis store: many replicas share one queue and one count of slots (`store.RedisQueue`).
The scripts (`scripts`, `lua/`) are the only writers of the shared state; `codec` carries their
arguments and replies, `grants` this replica's tickets and the slots granted to them, `presence`
the replicas' heartbeats and the fallback when Redis is away, `returns` the shared return
schedules."""
