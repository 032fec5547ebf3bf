-- Take a ticket out of its queue.
-- A: ticket, bands, backends, now (tests).
-- Returns {removed: true when it was still queued, false when it was granted (its grant is on the
--          way) or purged; view}.
local now = now_s()
local removed = unqueue(A.ticket)
if removed and queued_total(A.bands) == 0 then redis.call('HDEL', tag .. ':stats', 'backlog_at') end
return cjson.encode({removed = removed, view = view(A.bands, A.backends, now)})
