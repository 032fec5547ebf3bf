-- The replicas another's probe may find gone (gateway/queues/redis/peers.py), with their beacons:
-- the absent ones, and the live ones (other than the caller) whose grant list has a head, which the
-- caller compares with the head it saw at its last look: a live replica takes its grants within
-- milliseconds, so a head that stays is one whose process may be dead, with every slot handed to
-- it lost until its heartbeat lapses.
-- Also the live replicas and the config each runs (c: its hash), for the status page.
-- A: replica (the caller), now (tests).
-- Returns {absent: {replica: beacon}, heads: {replica: {a: beacon, h: its list's head}},
-- live: {replica: config hash}}.
local now = now_s()
local absent, heads, seen = {}, {}, {}
local function peer(replica)
  local raw = redis.call('HGET', tag .. ':peer', replica)
  return raw and cjson.decode(raw) or {}
end
for _, replica in ipairs(redis.call('ZRANGE', tag .. ':absent', 0, -1)) do
  absent[replica] = peer(replica).a
end
for _, replica in ipairs(redis.call('ZRANGEBYSCORE', tag .. ':replicas', '(' .. fmt(now), '+inf')) do
  local info = peer(replica)
  seen[replica] = info.c or ''
  if replica ~= A.replica and info.a then
    local head = redis.call('LINDEX', tag .. ':grants:' .. replica, 0)
    if head then heads[replica] = {a = info.a, h = head} end
  end
end
-- cjson encodes an empty table as an array: a marker keeps each an object.
absent['~'] = ''
heads['~'] = {}
seen['~'] = ''
return cjson.encode({absent = absent, heads = heads, live = seen})
