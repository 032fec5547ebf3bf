-- A replica is alive: extend its liveness and every lease it holds.
-- ARGV: replica, lease_ttl_s, replicas the config expects.
-- A lease that already expired (and was reaped) is not brought back: its slot was reused.
local replica, ttl = ARGV[1], tonumber(ARGV[2])
local now = now_s()
redis.call('ZADD', tag .. ':replicas', now + ttl, replica)
redis.call('HSET', tag .. ':stats', 'replicas_expected', ARGV[3])
local held = redis.call('SMEMBERS', tag .. ':held:' .. replica)
for _, lease in ipairs(held) do
  redis.call('ZADD', tag .. ':leases', 'XX', now + ttl, lease)
end
return #held
