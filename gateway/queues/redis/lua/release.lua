-- Free a lease's slot (idempotent) and hand it to the next waiter.
-- A: lease, bands, ttl, replica (the caller), backends, bound_s, sample (false: the slot comes
--    back unused, so the hand-over that follows says nothing of the drain rate), now (tests).
-- Only a live replica frees its own leases: once its heartbeat lapsed they stay reserved (see
-- reserve_absent), since it may be serving from its fallback on their capacity; and after Redis
-- lost its state a lease id may be another replica's.
-- Returns {freed, granted, view, mine: the grants for the caller, held: the seconds the lease was
-- held, from its grant (absent where it was not freed here)}.
local now = now_s()
local granted, mine = 0, {}
local freed, held = false, nil
if lease_owner(A.lease) == A.replica and live(A.replica, now) then
  local started = redis.call('ZSCORE', tag .. ':started', A.lease)
  freed = free_lease(A.lease)
  if freed and started then held = now - tonumber(started) end
end
if freed then granted, mine = dispatch(A.bands, A.backends, A.ttl, now, A.sample, A.replica) end
local reply = {freed = freed, granted = granted, view = view(A.bands, A.backends, now), mine = mine}
reply.held = held
return cjson.encode(reply)
