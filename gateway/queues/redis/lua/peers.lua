-- The replicas another's probe may find gone (gateway/queues/redis/peers.py), with their beacons:
-- the absent ones, and the live ones (other than the caller) whose grant list has a head, which the
-- caller compares with the head it saw at its last look: a live replica takes its grants within
-- milliseconds, so a head that stays is one whose process may be dead, with every slot handed to
-- it lost until its heartbeat lapses.
-- A: replica (the caller), now (tests).
-- Returns {absent: {replica: beacon}, heads: {replica: {a: beacon, h: its list's head}}}.
local now = now_s()
local absent, heads = {}, {}
for _, replica in ipairs(redis.call('ZRANGE', tag .. ':absent', 0, -1)) do
  local raw = redis.call('HGET', tag .. ':peer', replica)
  if raw then absent[replica] = cjson.decode(raw).a end
end
for _, replica in ipairs(redis.call('ZRANGEBYSCORE', tag .. ':replicas', '(' .. fmt(now), '+inf')) do
  if replica ~= A.replica then
    local head = redis.call('LINDEX', tag .. ':grants:' .. replica, 0)
    local raw = head and redis.call('HGET', tag .. ':peer', replica)
    if raw then heads[replica] = {a = cjson.decode(raw).a, h = head} end
  end
end
-- cjson encodes an empty table as an array: a marker keeps both objects.
absent['~'] = ''
heads['~'] = {}
return cjson.encode({absent = absent, heads = heads})
