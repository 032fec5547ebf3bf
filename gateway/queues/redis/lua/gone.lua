-- A replica whose beacon a peer found gone (gateway/queues/redis/peers.py): its process is dead, so
-- its connections to the backends closed with it and no fallback of its can start work. Each of
-- its reserved leases ends now on a backend that stops on a closed connection (A.abort), and within
-- the bound the replica last published (<tag>:peer, d: how long a request may compute on) on one
-- that finishes the work anyway; never later than its reservation did. Then the freed slots are
-- dispatched.
-- A: replica, abort ([backend url]), stuck (true: its heartbeat has not lapsed yet, its grants
--    stayed untaken: it is made absent first), bands, ttl, backends, bound_s, now (tests).
-- Otherwise only a replica Redis holds as absent: a live one (it rejoined) is not gone.
-- Returns {freed, granted}.
local now = now_s()
if live(A.replica, now) then
  if not A.stuck then return cjson.encode({freed = 0, granted = 0}) end
  reserve_absent(A.replica, now)  -- its untaken grants are freed, its tickets dropped
end
if not redis.call('ZSCORE', tag .. ':absent', A.replica) then
  redis.call('HDEL', tag .. ':peer', A.replica)
  return cjson.encode({freed = 0, granted = dispatch(A.bands, A.backends, A.ttl, now, false, nil)})
end
local raw = redis.call('HGET', tag .. ':peer', A.replica)
local peer = raw and cjson.decode(raw) or {}
local drain_until = now + tonumber(peer.d or '0')
local abort = {}
for _, url in ipairs(A.abort) do abort[url] = true end
local freed, reserved_until = 0, 0
for _, lease in ipairs(redis.call('SMEMBERS', tag .. ':held:' .. A.replica)) do
  local url = string.match(redis.call('HGET', tag .. ':lease', lease) or '', '^(.*)|[^|]*$')
  local ends = tonumber(redis.call('ZSCORE', tag .. ':leases', lease) or '0')
  if url and abort[url] then ends = now else ends = math.min(ends, drain_until) end
  if ends <= now then
    if free_lease(lease) then freed = freed + 1 end
  else
    redis.call('ZADD', tag .. ':leases', 'XX', ends, lease)
    reserved_until = math.max(reserved_until, ends)
  end
end
redis.call('HDEL', tag .. ':peer', A.replica)
local recovery_until = stat('recovery_until')
if recovery_until > now then redis.call('ZADD', tag .. ':gone', recovery_until, A.replica) end
redis.call('ZREMRANGEBYSCORE', tag .. ':gone', '-inf', now)
if reserved_until > now then
  redis.call('ZADD', tag .. ':absent', reserved_until, A.replica)
else
  redis.call('ZREM', tag .. ':absent', A.replica)
end
local granted = dispatch(A.bands, A.backends, A.ttl, now, false, nil)
return cjson.encode({freed = freed, granted = granted})
