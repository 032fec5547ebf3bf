-- A replica joins, or rejoins after its heartbeat lapsed or it lost Redis, in one step so that no
-- dispatch sees half of it:
-- 1. when this state is new (Redis lost what it held, or this is the first replica ever), open
--    the window in which replicas Redis does not know are presumed to run their fallback's share,
--    and all of each backend for a TTL first where Redis lost it (`lost`: this replica had joined);
-- 2. become live (from here on its leases are renewed by its heartbeat);
-- 3. publish the backends' readiness it sees;
-- 4. replace its reservation as an absent replica by its real work: drop what it left behind
--    (queued tickets of requests that moved on, undelivered grants, leases it no longer uses),
--    renew the leases it still uses, and count again those Redis forgot (a restart without
--    persistence), under new ids;
-- 5. hold what its fallback still uses, as leases (reserved);
-- 6. dispatch.
-- A: replica, bands, ttl, hold_s, share and peer (as in heartbeat.lua), window (how long step 1
--    presumes), lost, expected, backends, bound_s, ready ({u, r} each), reserve ({u, n} each), keep
--    ({l: lease, u: url} each: the leases it still uses), now (tests).
-- Returns {dropped, freed, granted, reserved: lease ids, renamed: {old, new} pairs}.
local now = now_s()
local replica = A.replica

if not redis.call('HGET', tag .. ':stats', 'epoch') then
  redis.call('HSET', tag .. ':stats', 'epoch', fmt(now))
  if A.lost == 1 then
    -- This replica had joined before: Redis lost what it held, and the replicas it does not know
    -- yet may run as much as they did, until their next beat or probe could have rejoined them.
    redis.call('HSET', tag .. ':stats', 'unknown_until', fmt(now + A.ttl))
  end
  if now + A.window > stat('recovery_until') then
    redis.call('HSET', tag .. ':stats', 'recovery_until', fmt(now + A.window))
  end
end
redis.call('HSET', tag .. ':stats', 'replicas_expected', A.expected)

-- What Redis counts for it now, before any lease is granted below: a lease it still uses and
-- Redis does not hold for it was forgotten, and a new state counts ids from 1 again.
local held = {}
for _, lease in ipairs(redis.call('SMEMBERS', tag .. ':held:' .. replica)) do held[lease] = true end

redis.call('ZADD', tag .. ':replicas', now + A.ttl, replica)
redis.call('HSET', tag .. ':hold', replica, hold_entry(now))
publish_peer(replica)
redis.call('ZREM', tag .. ':absent', replica)
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
local freed = 0
for lease in pairs(held) do
  if not keep[lease] and free_lease(lease) then freed = freed + 1 end
end
for lease, url in pairs(keep) do
  if held[lease] then
    redis.call('ZADD', tag .. ':leases', now + A.ttl, lease)
  else  -- forgotten (or lapsed): counted again, under a new id
    renamed[#renamed + 1] = {lease, grant_lease(url, replica, A.ttl, now, A.bands - 1, '', 1)}
  end
end

-- Work the fallback started counts as the least urgent band's against reservations and as the
-- unnamed flow's against quotas: neither is known here, and so it can only keep less urgent
-- classes and borrowers out, never an urgent class or an owner.
local reserved = {}
for _, share in ipairs(A.reserve) do
  for _ = 1, share.n do reserved[#reserved + 1] = grant_lease(share.u, replica, A.ttl, now, A.bands - 1, '', 1) end
end

local granted = dispatch(A.bands, A.backends, A.ttl, now, false, nil)
return cjson.encode({dropped = dropped, freed = freed, granted = granted, reserved = reserved, renamed = renamed})
