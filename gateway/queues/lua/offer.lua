-- Admission check and insert in one step: grant a free slot, queue, or refuse.
-- ARGV: replica, band, max_positions, nbands, ordering, allowed_s, lease_ttl_s, tau_slow, tau_fast,
--       jump_tick_s, jump_z, jump_min_events (gateway.flow.estimates), nbands counts of arrivals
--       refused locally, nbackends, (url, max_concurrency, queued) x nbackends
-- Returns {'granted', lease, url, snapshot} | {'queued', ticket, snapshot} | {'full', snapshot}.
local replica, band = ARGV[1], tonumber(ARGV[2])
local max_positions, nbands = tonumber(ARGV[3]), tonumber(ARGV[4])
local ordering, allowed, ttl = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local tau_slow, tau_fast = tonumber(ARGV[8]), tonumber(ARGV[9])
local jump = {tick = tonumber(ARGV[10]), z = tonumber(ARGV[11]), min_events = tonumber(ARGV[12])}
local backends = read_backends(14 + nbands)
local now = now_s()
count_refused_locally(13, nbands, now, tau_slow)

local depths = queued(nbands)
local ahead = 0
for b = 0, band do ahead = ahead + depths[b + 1] end
local positions = math.max(0, ahead + 1 - free_slots(backends))
count_events('off:' .. band, now, tau_slow, 1)
if positions > max_positions then
  return {'full', snapshot(nbands, backends, now, tau_slow, tau_fast)}
end
count_admission(band, now, tau_slow, tau_fast, jump)

if positions == 0 then
  local backend = pick_backend(backends)
  if backend ~= nil then
    local lease = grant_lease(backend, replica, ttl, now)
    return {'granted', lease, backend.url, snapshot(nbands, backends, now, tau_slow, tau_fast)}
  end
end
local id = next_id()
local score = now
if ordering == 'edf' then score = now + allowed end
redis.call('ZADD', tag .. ':q:' .. band, score, id)
redis.call('HSET', tag .. ':tickets', id, replica .. '|' .. band)
redis.call('SADD', tag .. ':waiting:' .. replica, id)
return {'queued', id, snapshot(nbands, backends, now, tau_slow, tau_fast)}
