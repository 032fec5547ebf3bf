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
-- ARGV: replica, nbands, lease_ttl_s, drain_tau, window_s, replicas_expected,
--       nbackends, (url, max_concurrency, queued)..., nready, (url, '0'|'1')..., nreserve, (url, count)...,
--       then (lease, url) pairs of the leases it still uses.
-- Returns {tickets dropped, leases freed, grants, {reserved lease ids}, {old lease, new lease}...}.
local replica, nbands = ARGV[1], tonumber(ARGV[2])
local ttl, drain_tau, window = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local backends, i = read_backends(8)
local now = now_s()

if now + window > tonumber(redis.call('HGET', tag .. ':stats', 'recovery_until') or '0') then
  redis.call('HSET', tag .. ':stats', 'recovery_until', fmt(now + window))
end
redis.call('HSET', tag .. ':stats', 'replicas_expected', ARGV[6])

local nready = tonumber(ARGV[i])
local ready_at = i + 1
i = i + 1 + 2 * nready

local reserved = {}
local nreserve = tonumber(ARGV[i])
for r = 0, nreserve - 1 do
  local url, count = ARGV[i + 1 + 2 * r], tonumber(ARGV[i + 2 + 2 * r])
  for _ = 1, count do reserved[#reserved + 1] = grant_lease({url = url}, replica, ttl, now) end
end
i = i + 1 + 2 * nreserve

redis.call('ZADD', tag .. ':replicas', now + ttl, replica)
for r = 0, nready - 1 do
  redis.call('HSET', tag .. ':ready', ARGV[ready_at + 2 * r], ARGV[ready_at + 2 * r + 1])
end

local dropped = 0
for _, id in ipairs(redis.call('SMEMBERS', tag .. ':waiting:' .. replica)) do
  local info = redis.call('HGET', tag .. ':tickets', id)
  if info then
    redis.call('ZREM', tag .. ':q:' .. string.match(info, '|(%d+)$'), id)
    redis.call('HDEL', tag .. ':tickets', id)
    dropped = dropped + 1
  end
end
redis.call('DEL', tag .. ':waiting:' .. replica, tag .. ':grants:' .. replica)

local keep, renamed = {}, {}
for k = i, #ARGV, 2 do keep[ARGV[k]] = ARGV[k + 1] end
for _, lease in ipairs(reserved) do keep[lease] = true end
local freed = 0
for _, lease in ipairs(redis.call('SMEMBERS', tag .. ':held:' .. replica)) do
  if not keep[lease] and free_lease(lease) then freed = freed + 1 end
end
for lease, url in pairs(keep) do
  if url ~= true and redis.call('HEXISTS', tag .. ':lease', lease) == 0 then
    renamed[#renamed + 1] = lease
    renamed[#renamed + 1] = grant_lease({url = url}, replica, ttl, now)
  end
end

local granted = dispatch(nbands, backends, ttl, now, false, drain_tau)
return {dropped, freed, granted, reserved, renamed}
