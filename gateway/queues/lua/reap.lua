-- Reclaim what dead replicas left: their slots, their queued tickets (their clients are gone),
-- and any lease past its expiry; then dispatch into the freed slots.
-- ARGV: nbands, lease_ttl_s, drain_tau, nbackends, (url, max_concurrency, queued)...
-- Returns {dead replicas, expired leases, grants}.
local nbands, ttl, drain_tau = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local backends = read_backends(5)
local now = now_s()
local dead = redis.call('ZRANGEBYSCORE', tag .. ':replicas', '-inf', now)
for _, replica in ipairs(dead) do
  redis.call('ZREM', tag .. ':replicas', replica)
  for _, lease in ipairs(redis.call('SMEMBERS', tag .. ':held:' .. replica)) do free_lease(lease) end
  for _, id in ipairs(redis.call('SMEMBERS', tag .. ':waiting:' .. replica)) do
    local info = redis.call('HGET', tag .. ':tickets', id)
    if info then
      local band = string.match(info, '|(%d+)$')
      redis.call('ZREM', tag .. ':q:' .. band, id)
      redis.call('HDEL', tag .. ':tickets', id)
    end
  end
  redis.call('DEL', tag .. ':held:' .. replica, tag .. ':waiting:' .. replica, tag .. ':grants:' .. replica)
end
local expired = redis.call('ZRANGEBYSCORE', tag .. ':leases', '-inf', now)
for _, lease in ipairs(expired) do free_lease(lease) end
local granted = dispatch(nbands, backends, ttl, now, false, drain_tau)
return {#dead, #expired, granted}
