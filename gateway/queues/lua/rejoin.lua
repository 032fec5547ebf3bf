-- A replica rejoins after losing Redis, in one step so that no dispatch sees half of it:
-- 1. open (or extend) the recovery window, in which replicas that have not rejoined yet are
--    presumed to run requests on their local share of each backend;
-- 2. hold the share this replica's fallback still uses, as leases;
-- 3. beat again (from here on its own share counts through those leases, not the presumption);
-- 4. publish the backends' readiness it sees;
-- 5. drop what it left behind: queued tickets of requests that moved on, undelivered grants, and
--    leases it no longer uses; count again the slots it still uses that Redis forgot (a restart
--    without persistence);
-- 6. dispatch.
-- A: replica, bands, ttl, window, expected, backends, ready ({u, r} each), reserve ({u, n} each),
--    keep ({l: lease, u: url} each: the leases it still uses), now (tests).
-- Returns {dropped, freed, granted, reserved: lease ids, renamed: {old, new} pairs}.
local now = now_s()
local replica = A.replica

if now + A.window > stat('recovery_until') then
  redis.call('HSET', tag .. ':stats', 'recovery_until', fmt(now + A.window))
end
redis.call('HSET', tag .. ':stats', 'replicas_expected', A.expected)

local reserved = {}
for _, share in ipairs(A.reserve) do
  for _ = 1, share.n do reserved[#reserved + 1] = grant_lease(share.u, replica, A.ttl, now) end
end

redis.call('ZADD', tag .. ':replicas', now + A.ttl, replica)
for _, entry in ipairs(A.ready) do
  redis.call('HSET', tag .. ':ready', entry.u, entry.r)
end

local dropped = 0
for _, id in ipairs(redis.call('SMEMBERS', tag .. ':waiting:' .. replica)) do
  if unqueue(id) then dropped = dropped + 1 end
end
redis.call('DEL', tag .. ':waiting:' .. replica, tag .. ':grants:' .. replica)

local keep, renamed = {}, {}
for _, kept in ipairs(A.keep) do keep[kept.l] = kept.u end
for _, lease in ipairs(reserved) do keep[lease] = true end
local freed = 0
for _, lease in ipairs(redis.call('SMEMBERS', tag .. ':held:' .. replica)) do
  if not keep[lease] and free_lease(lease) then freed = freed + 1 end
end
for lease, url in pairs(keep) do
  if url ~= true and redis.call('HEXISTS', tag .. ':lease', lease) == 0 then
    renamed[#renamed + 1] = {lease, grant_lease(url, replica, A.ttl, now)}
  end
end

local granted = dispatch(A.bands, A.backends, A.ttl, now, false, nil)
return cjson.encode({dropped = dropped, freed = freed, granted = granted, reserved = reserved, renamed = renamed})
