-- The shared concurrency limit of a backend whose limit the gateway finds (max_concurrency: auto):
-- one replica leads and writes the limit its control law computes; the others take it. The lead
-- passes to whoever asks once the leader has not renewed it for A.lead_ttl seconds.
-- A: replica, url, slots (the caller's limit), lead_ttl.
-- Returns {lead = 1|0, slots = the limit to use}.
local key = tag .. ':limit:' .. A.url
local now = now_s()
local leader = redis.call('HGET', key, 'leader')
local lead_until = tonumber(redis.call('HGET', key, 'until') or '0')
if leader == A.replica or not leader or lead_until < now then
  redis.call('HSET', key, 'leader', A.replica, 'until', fmt(now + A.lead_ttl), 'slots', A.slots)
  return cjson.encode({lead = 1, slots = A.slots})
end
return cjson.encode({lead = 0, slots = tonumber(redis.call('HGET', key, 'slots'))})
