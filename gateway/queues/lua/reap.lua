-- Reclaim what dead replicas left: their slots, their queued tickets (their clients are gone),
-- and any lease past its expiry; then dispatch into the freed slots.
-- A: bands, ttl, backends, now (tests).
-- Returns {dead: replicas, expired: leases, granted}.
local now = now_s()
local dead = redis.call('ZRANGEBYSCORE', tag .. ':replicas', '-inf', now)
for _, replica in ipairs(dead) do
  redis.call('ZREM', tag .. ':replicas', replica)
  for _, lease in ipairs(redis.call('SMEMBERS', tag .. ':held:' .. replica)) do free_lease(lease) end
  for _, id in ipairs(redis.call('SMEMBERS', tag .. ':waiting:' .. replica)) do unqueue(id) end
  redis.call('DEL', tag .. ':held:' .. replica, tag .. ':waiting:' .. replica, tag .. ':grants:' .. replica)
end
local expired = redis.call('ZRANGEBYSCORE', tag .. ':leases', '-inf', now)
for _, lease in ipairs(expired) do free_lease(lease) end
local granted = dispatch(A.bands, A.backends, A.ttl, now, false, nil)
return cjson.encode({dead = #dead, expired = #expired, granted = granted})
