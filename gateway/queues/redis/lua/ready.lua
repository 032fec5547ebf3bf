-- Record backend readiness seen by a replica, then dispatch into slots that became usable.
-- A: bands, ttl, backends, ready ({u: url, r: '0'|'1'} each), now (tests).
-- Returns the number of grants.
local now = now_s()
for _, entry in ipairs(A.ready) do
  redis.call('HSET', tag .. ':ready', entry.u, entry.r)
end
return dispatch(A.bands, A.backends, A.ttl, now, false, nil)
