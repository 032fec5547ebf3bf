-- Free a lease's slot (idempotent) and hand it to the next waiter.
-- A: lease, bands, ttl, replica (the caller), backends, sample (false: the slot comes back
--    unused, so the hand-over that follows says nothing of the drain rate), now (tests).
-- Returns {freed, granted, view, mine: the grants for the caller}.
local now = now_s()
local granted, mine = 0, {}
local freed = free_lease(A.lease)
if freed then granted, mine = dispatch(A.bands, A.backends, A.ttl, now, A.sample, A.replica) end
return cjson.encode({freed = freed, granted = granted, view = view(A.bands, A.backends, now), mine = mine})
