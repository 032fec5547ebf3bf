-- Take a ticket out of its queue. ARGV: ticket, band, replica, nbands.
-- Returns 1 when it was still queued, 0 when it was granted (its grant is on the way) or purged.
local id, band, replica, nbands = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local removed = redis.call('ZREM', tag .. ':q:' .. band, id)
if removed == 1 then
  redis.call('HDEL', tag .. ':tickets', id)
  redis.call('SREM', tag .. ':waiting:' .. replica, id)
  local _, total = queued(nbands)
  if total == 0 then redis.call('HDEL', tag .. ':stats', 'backlog_at') end
end
return removed
