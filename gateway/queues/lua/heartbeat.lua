-- A replica is alive: extend its liveness and every lease it holds.
-- A: replica, ttl, expected (replicas the config expects), now (tests).
-- A lease that already expired (and was reaped) is not brought back: its slot was reused.
local now = now_s()
redis.call('ZADD', tag .. ':replicas', now + A.ttl, A.replica)
redis.call('HSET', tag .. ':stats', 'replicas_expected', A.expected)
local held = redis.call('SMEMBERS', tag .. ':held:' .. A.replica)
for _, lease in ipairs(held) do
  redis.call('ZADD', tag .. ':leases', 'XX', now + A.ttl, lease)
end
return #held
