-- The grants a replica's listener popped and never read: a BLMPOP whose connection broke with its
-- reply on the way. They are the leases pushed onto its list that Redis still counts for it, that
-- are not in the list any more, and that the replica neither holds nor is releasing. Each is renewed
-- for a TTL (it was renewed as undelivered until popped, and named by no beat since): the replica
-- takes it from here, as if popped. A replica whose heartbeat lapsed gets none: it rejoins.
-- A: replica, known (the leases it holds or is releasing), ttl, now (tests).
-- Returns {grants: [each as it was pushed]}.
local now = now_s()
local lost = {}
if live(A.replica, now) then
  local known = undelivered(A.replica)
  for _, lease in ipairs(A.known) do known[lease] = true end
  for _, lease in ipairs(redis.call('SMEMBERS', tag .. ':held:' .. A.replica)) do
    local grant = redis.call('HGET', tag .. ':posted', lease)
    local expiry = redis.call('ZSCORE', tag .. ':leases', lease)
    if grant and not known[lease] and expiry and tonumber(expiry) > now then
      redis.call('ZADD', tag .. ':leases', 'XX', now + A.ttl, lease)
      lost[#lost + 1] = grant
    end
  end
end
return cjson.encode({grants = lost})
