-- Shared by every script of the Redis store (prepended to each at load time).
--
-- All keys of one model share the hash tag in KEYS[1] ("{<prefix>:<model>}"), so a model's
-- state lives in one slot and the scripts also run on Redis Cluster:
--   <tag>:q:<band>       zset  ticket id -> ordering score (FIFO: arrival time; EDF: leave-by)
--   <tag>:tickets        hash  ticket id -> "<replica>|<band>"
--   <tag>:slots          hash  backend url -> slots in use, over all replicas
--   <tag>:ready          hash  backend url -> "1" when ready
--   <tag>:leases         zset  lease id -> expiry time
--   <tag>:lease          hash  lease id -> "<backend url>|<replica>"
--   <tag>:stats          hash  drain and arrival-rate estimates
--   <tag>:replicas       zset  replica -> heartbeat expiry
--   <tag>:seq            counter for ticket and lease ids
--   <tag>:grants:<r>     list  grants for replica r: "<ticket>|<lease>|<backend url>"
--   <tag>:held:<r>       set   leases held by replica r
--   <tag>:waiting:<r>    set   tickets queued by replica r
-- Time is Redis's own (TIME), so every replica orders and expires by the same clock.

local tag = KEYS[1]

local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Lua's tostring keeps 14 digits: too few for epoch seconds to the microsecond.
local function fmt(x)
  return string.format('%.6f', x)
end

-- Backends come as ARGV triples (url, max_concurrency, requests the backend reports queued
-- inside it) starting at `first`, their count at first - 1.
local function read_backends(first)
  local count = tonumber(ARGV[first - 1])
  local backends = {}
  for i = 0, count - 1 do
    local at = first + 3 * i
    backends[#backends + 1] = {url = ARGV[at], cap = tonumber(ARGV[at + 1]), queued = tonumber(ARGV[at + 2])}
  end
  return backends, first + 3 * count
end

-- For a while after Redis comes back (a replica rejoining from its fallback opens the window),
-- replicas that have not rejoined yet may still run requests on their local share of each
-- backend: their shares count as used, so the shared count stays an upper bound.
local absent_cache = nil
local function absent_replicas()
  if absent_cache == nil then
    local now = now_s()
    absent_cache = 0
    if now < tonumber(redis.call('HGET', tag .. ':stats', 'recovery_until') or '0') then
      local expected = tonumber(redis.call('HGET', tag .. ':stats', 'replicas_expected') or '1')
      local live = redis.call('ZCOUNT', tag .. ':replicas', now, '+inf')
      absent_cache = math.max(0, expected - live)
    end
  end
  return absent_cache
end

local function slots_used(b)
  local used = tonumber(redis.call('HGET', tag .. ':slots', b.url) or '0')
  local absent = absent_replicas()
  if absent > 0 then
    local expected = tonumber(redis.call('HGET', tag .. ':stats', 'replicas_expected') or '1')
    used = used + absent * math.max(1, math.floor(b.cap / expected))
  end
  return used
end

local function free_slots(backends)
  local free = 0
  for _, b in ipairs(backends) do
    if redis.call('HGET', tag .. ':ready', b.url) == '1' then
      local used = slots_used(b)
      if used < b.cap then free = free + b.cap - used end
    end
  end
  return free
end

-- The least loaded ready backend with a free slot: share of its slots in use plus what it reports
-- queued inside it (others' work); ties go to the first listed.
local function pick_backend(backends)
  local best, best_load = nil, nil
  for _, b in ipairs(backends) do
    if redis.call('HGET', tag .. ':ready', b.url) == '1' then
      local used = slots_used(b)
      if used < b.cap then
        local load = (used + b.queued) / b.cap
        if best == nil or load < best_load then best, best_load = b, load end
      end
    end
  end
  return best
end

local function queued(nbands)
  local depths, total = {}, 0
  for band = 0, nbands - 1 do
    local n = redis.call('ZCARD', tag .. ':q:' .. band)
    depths[#depths + 1] = n
    total = total + n
  end
  return depths, total
end

-- An exponentially decayed event rate kept in two stats fields: level at time `at`.
local function rate_at(field, now, tau)
  local level = tonumber(redis.call('HGET', tag .. ':stats', field) or '0')
  local at = tonumber(redis.call('HGET', tag .. ':stats', field .. '_at') or tostring(now))
  return level * math.exp(-math.max(0, now - at) / tau)
end

local function count_events(field, now, tau, n)
  local level = rate_at(field, now, tau) + n / tau
  redis.call('HSET', tag .. ':stats', field, tostring(level), field .. '_at', fmt(now))
end

-- Admissions are also counted per interval of `jump.tick` seconds. A count too large for the
-- current level to explain (Poisson, `jump.z` deviations: policies.estimators.rate_jump) sets both
-- rates to the count's own rate, so that a step to overload is believed within one interval
-- rather than after seconds of averaging.
local function count_admission(band, now, tau_slow, tau_fast, jump)
  local stats = tag .. ':stats'
  local slow_field, fast_field, tick_field = 'adm:' .. band, 'admf:' .. band, 'admt:' .. band
  local started = tonumber(redis.call('HGET', stats, tick_field .. '_at') or tostring(now))
  local count = tonumber(redis.call('HGET', stats, tick_field) or '0')
  local elapsed = now - started
  if elapsed >= jump.tick then
    local level = math.max(rate_at(slow_field, now, tau_slow), rate_at(fast_field, now, tau_fast))
    local expected = level * elapsed
    if count >= jump.min_events and count > expected + jump.z * math.sqrt(math.max(expected, 1)) then
      local level_now = fmt(count / elapsed)
      redis.call('HSET', stats, slow_field, level_now, slow_field .. '_at', fmt(now),
        fast_field, level_now, fast_field .. '_at', fmt(now))
    end
    started, count = now, 0
  end
  redis.call('HSET', stats, tick_field, tostring(count + 1), tick_field .. '_at', fmt(started))
  count_events(slow_field, now, tau_slow, 1)
  count_events(fast_field, now, tau_fast, 1)
end

-- Arrivals a replica refused on its own (from a fresh snapshot, without a round trip) still count
-- towards the offered rates: ARGV carries them per band from `first`.
local function count_refused_locally(first, nbands, now, tau)
  for band = 0, nbands - 1 do
    local n = tonumber(ARGV[first + band])
    if n > 0 then count_events('off:' .. band, now, tau, n) end
  end
end

-- Ids are zero-padded so that equal scores in a zset still order by creation (FIFO).
local function next_id()
  return string.format('%015d', redis.call('INCR', tag .. ':seq'))
end

local function grant_lease(backend, replica, ttl, now)
  local lease = next_id()
  redis.call('HINCRBY', tag .. ':slots', backend.url, 1)
  redis.call('ZADD', tag .. ':leases', now + ttl, lease)
  redis.call('HSET', tag .. ':lease', lease, backend.url .. '|' .. replica)
  redis.call('SADD', tag .. ':held:' .. replica, lease)
  return lease
end

-- Free a lease's slot; false when it was already freed (release is idempotent).
local function free_lease(lease)
  local info = redis.call('HGET', tag .. ':lease', lease)
  if not info then return false end
  local url, replica = string.match(info, '^(.*)|([^|]*)$')
  redis.call('HDEL', tag .. ':lease', lease)
  redis.call('ZREM', tag .. ':leases', lease)
  redis.call('SREM', tag .. ':held:' .. replica, lease)
  if tonumber(redis.call('HINCRBY', tag .. ':slots', url, -1)) < 0 then
    redis.call('HSET', tag .. ':slots', url, 0)
  end
  return true
end

-- Hand free slots to waiting tickets, most urgent band first, FIFO (by score) within a band.
-- `drain_sample`: one slot just freed, so a hand-over under backlog is a sample of the drain
-- rate (hand-overs per second of backlog, forgotten over drain_tau seconds).
-- Grants go onto their replica's list, except those for `caller`, which are returned: the
-- replica that runs the script delivers them itself, without a trip through its list.
local function dispatch(nbands, backends, ttl, now, drain_sample, drain_tau, caller)
  local granted, mine = 0, {}
  while true do
    local backend = pick_backend(backends)
    if backend == nil then break end
    local id = nil
    for band = 0, nbands - 1 do
      local popped = redis.call('ZPOPMIN', tag .. ':q:' .. band)
      if #popped > 0 then id = popped[1] break end
    end
    if id == nil then break end
    local info = redis.call('HGET', tag .. ':tickets', id)
    if info then
      redis.call('HDEL', tag .. ':tickets', id)
      local replica = string.match(info, '^([^|]*)')
      redis.call('SREM', tag .. ':waiting:' .. replica, id)
      local lease = grant_lease(backend, replica, ttl, now)
      local grant = id .. '|' .. lease .. '|' .. backend.url
      if replica == caller then
        mine[#mine + 1] = grant
      else
        redis.call('RPUSH', tag .. ':grants:' .. replica, grant)
      end
      granted = granted + 1
      if drain_sample then
        local last = redis.call('HGET', tag .. ':stats', 'backlog_at')
        if last then
          local gap = math.max(0, now - tonumber(last))
          local decay = math.exp(-gap / drain_tau)
          local events = tonumber(redis.call('HGET', tag .. ':stats', 'drain_events') or '0') * decay + 1
          local observed = tonumber(redis.call('HGET', tag .. ':stats', 'drain_observed') or '0') * decay + gap
          redis.call('HSET', tag .. ':stats', 'drain_events', tostring(events),
            'drain_observed', tostring(observed), 'drain_at', fmt(now))
        end
      end
    end
  end
  -- Mark a hand-over that left requests waiting: the gap to the next one is a clean drain sample.
  local _, total = queued(nbands)
  if total > 0 and drain_sample and granted > 0 then
    redis.call('HSET', tag .. ':stats', 'backlog_at', fmt(now))
  elseif total == 0 or granted > 0 then
    redis.call('HDEL', tag .. ':stats', 'backlog_at')
  end
  return granted, mine
end

-- What admission and metrics need, as one flat list:
-- now, free, drain_events, drain_observed, drain_at, then per band: depth, offered, admitted.
local function snapshot(nbands, backends, now, tau_slow, tau_fast)
  local out = {fmt(now), free_slots(backends)}
  local stats = tag .. ':stats'
  out[#out + 1] = redis.call('HGET', stats, 'drain_events') or '0'
  out[#out + 1] = redis.call('HGET', stats, 'drain_observed') or '0'
  out[#out + 1] = redis.call('HGET', stats, 'drain_at') or '0'
  for band = 0, nbands - 1 do
    out[#out + 1] = redis.call('ZCARD', tag .. ':q:' .. band)
    out[#out + 1] = tostring(rate_at('off:' .. band, now, tau_slow))
    local slow = rate_at('adm:' .. band, now, tau_slow)
    local fast = rate_at('admf:' .. band, now, tau_fast)
    out[#out + 1] = tostring(math.max(slow, fast))
  end
  return out
end
