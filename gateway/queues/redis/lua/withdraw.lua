-- Take a ticket out of its queue (with quotas, then hand a free slot to what it held back).
-- A: ticket, bands, backends, ttl, quotas, now (tests).
-- Returns {removed: true when it was still queued, false when it was granted (its grant is on the
--          way) or purged; view}.
local now = now_s()
local removed = unqueue(A.ticket)
if removed and queued_total(A.bands) == 0 then redis.call('HDEL', tag .. ':stats', 'backlog_at') end
-- It may have been a head its quota held back, or an owner's that kept borrowers waiting: what was
-- behind it may start now, on a slot that would otherwise idle (as the memory store's withdraw).
if removed and A.quotas ~= nil and free_slots(A.backends) > 0 then
  dispatch(A.bands, A.backends, A.ttl, now, false, nil)
end
return cjson.encode({removed = removed, view = view(A.bands, A.backends, now)})
