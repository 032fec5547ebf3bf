-- Reserve what absent replicas hold (reserve_absent), free the leases past their expiry (a live
-- replica's whose release was lost, an absent one's whose work has surely ended), then dispatch
-- into the freed slots.
-- A: bands, ttl, backends, bound_s, leaving (a replica that stops: it leaves now, its leases
--    reserved until their bounds), now (tests).
-- Returns {dead: replicas, expired: leases, granted}.
local now = now_s()
if A.leaving then
  redis.call('HDEL', tag .. ':hold', A.leaving)
  redis.call('ZADD', tag .. ':replicas', 0, A.leaving)
end
local dead = reap_absent(now)
local expired = redis.call('ZRANGEBYSCORE', tag .. ':leases', '-inf', now)
for _, lease in ipairs(expired) do free_lease(lease) end
forget_absent(now)
local granted = dispatch(A.bands, A.backends, A.ttl, now, false, nil)
return cjson.encode({dead = dead, expired = #expired, granted = granted})
