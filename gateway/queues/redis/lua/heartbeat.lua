-- A live replica beats: it stays live, and the leases whose work it still runs are renewed.
-- A: replica, ttl, expected (replicas the config expects), hold_s (how long its leases stay
--    reserved once it is absent, from now; 0: each only until its own bound), share ({u: url, n}
--    each: the most its fallback may use of each backend), leases (the leases it uses: its
--    requests' and its fallback's reservations), peer ({c: its config's hash; a, d: its beacon}), bound_s,
--    now (tests).
-- A lease it no longer names (its release was lost) lapses within one TTL; one in its grant list,
-- not taken yet, is renewed. A replica whose heartbeat already lapsed is not brought back: its
-- leases are reserved as an absent replica's, and it must rejoin (rejoin.lua).
-- Returns {absent: true when it must rejoin}.
local now = now_s()
if not live(A.replica, now) then return cjson.encode({absent = true}) end
redis.call('ZADD', tag .. ':replicas', now + A.ttl, A.replica)
redis.call('HSET', tag .. ':hold', A.replica, hold_entry(now))
publish_peer(A.replica)
redis.call('HSET', tag .. ':stats', 'replicas_expected', A.expected)
local renewed = undelivered(A.replica)
for _, lease in ipairs(A.leases) do renewed[lease] = true end
local expiry = now + A.ttl
for _, lease in ipairs(redis.call('SMEMBERS', tag .. ':held:' .. A.replica)) do
  if renewed[lease] then
    redis.call('ZADD', tag .. ':leases', 'XX', expiry, lease)
  else
    local current = redis.call('ZSCORE', tag .. ':leases', lease)
    if current and tonumber(current) > expiry then redis.call('ZADD', tag .. ':leases', expiry, lease) end
  end
end
return cjson.encode({absent = false})
