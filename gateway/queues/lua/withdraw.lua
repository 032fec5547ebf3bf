-- Take a ticket out of its queue.
-- ARGV: ticket, band, replica, nbands, tau_slow, tau_fast, nbackends, (url, max_concurrency, queued)...
-- Returns {1 when it was still queued, 0 when it was granted (its grant is on the way) or purged;
--          snapshot}.
local id, band, replica, nbands = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local tau_slow, tau_fast = tonumber(ARGV[5]), tonumber(ARGV[6])
local backends = read_backends(8)
local removed = redis.call('ZREM', tag .. ':q:' .. band, id)
if removed == 1 then
  redis.call('HDEL', tag .. ':tickets', id)
  redis.call('SREM', tag .. ':waiting:' .. replica, id)
  local _, total = queued(nbands)
  if total == 0 then redis.call('HDEL', tag .. ':stats', 'backlog_at') end
end
return {removed, snapshot(nbands, backends, now_s(), tau_slow, tau_fast)}
