-- Shared by every script of the Redis store (prepended to each at load time).
--
-- Lua does only what must be atomic: check-and-insert, dispatch, leases, and the raw counters the
-- estimators need (totals, never decayed). Every rate, drain estimate and jump is computed in
-- Python, by one algorithm for both stores (gateway/queues/estimates.py).
--
-- Arguments come as one JSON object in ARGV[1] and replies go back as one JSON string, with named
-- fields on both sides (gateway/queues/redis/codec.py). Timestamps travel as strings: cjson keeps
-- 14 digits, too few for epoch seconds to the microsecond.
--
-- All keys of one model share the hash tag in KEYS[1] ("{<prefix>:<model>}"), so a model's
-- state lives in one slot and the scripts also run on Redis Cluster:
--   <tag>:q:<band>:<tenant> zset  ticket id -> ordering score (FIFO: 0, so ids keep the order of
--                                 arrival; EDF: leave-by)
--   <tag>:vt:<band>         string the band's virtual time (policies.fairness)
--   <tag>:finish:<band>     hash  tenant -> its flow's finish tag (moved by work handed a slot)
--   <tag>:fwork:<band>      hash  tenant -> its flow's queued work (backlogged flows only)
--   <tag>:fweight:<band>    hash  tenant -> the weight its flow was last admitted with (FIFO only)
--   <tag>:flows:<band>      zset  tenant -> its flow's head score (the band's flows with work; FIFO:
--                                 the head's start tag, taken as it became the head)
--   <tag>:tickets           hash  ticket id -> JSON {r: replica, b: band, t: tenant, c: cost,
--                                 e: leave-by time, k: batch key, m: batch cost limit,
--                                 q: its kind of request, policies.request_kinds; s: its sequence,
--                                 x: 1 when it ends it, p: the backend it is pinned to}
--   <tag>:queued            hash  "n<band>" -> tickets waiting, "w<band>" -> their work, "p<band>" -> the
--                                 pinned ones among them
--   <tag>:slots             hash  backend url -> slots in use, over all replicas
--   <tag>:ready             hash  backend url -> "1" when ready
--   <tag>:leases            zset  lease id -> expiry time (renewed while its work runs; once its
--                                 replica is absent: the latest its work could still be running)
--   <tag>:lease             hash  lease id -> "<backend url>|<replica>"
--   <tag>:lease_band        hash  lease id -> the band it was granted to
--   <tag>:held_band         hash  band -> slots its leases hold (policies.reservations)
--   <tag>:lease_tenant      hash  lease id -> JSON {t: tenant, c: cost}
--   <tag>:lease_kind        hash  lease id -> the kind of request it serves, where told (policies.request_kinds)
--   <tag>:tenant_held       hash  tenant -> work its leases hold (policies.quotas)
--   <tag>:granted           hash  "<band>:<tenant>" -> work granted slots (the tenants' shares)
--   <tag>:admitted          hash  "<band>:<tenant>" -> work admitted (its arrivals in turn ahead of others)
--   <tag>:bound             hash  lease id -> the latest the request it covers could still run
--                                 (granted + the replica's upstream timeout + one TTL)
--   <tag>:hold              hash  replica -> JSON {t: until when its leases stay reserved once it is
--                                 absent (its last heartbeat + how long it may serve from its
--                                 fallback + the longest a request runs + one TTL; 0: each lease
--                                 until its bound), s: {backend url: the most its fallback uses there}}
--   <tag>:absent            zset  replica -> end of its reservation (replicas reaped while their
--                                 leases stay reserved)
--   <tag>:gone              zset  replica -> the end of the window in which replicas Redis does not
--                                 know are presumed to run (recovery_until): a replica a probe
--                                 proved dead (gone.lua) is not one of them
--   <tag>:server            string the run id of the Redis process this state was written on (see
--                                 forget_state, at the end)
--   <tag>:peer              hash  replica -> JSON {c: the hash of the config it runs; with a beacon,
--                                 a: the beacon's host:port, d: how long a request of its may
--                                 compute on after its connection closed}, published with each
--                                 beat, kept while it is live or absent (peers.lua, gone.lua)
--   <tag>:stats             hash  raw counters: off:<band>, adm:<band> (work offered, admitted),
--                                 drained_work, drained_s, drained_at, handovers, handed_work;
--                                 backlog_at; recovery_until, unknown_until, replicas_expected;
--                                 pin_sweep_at (how many pins the next sweep of <tag>:pins waits for);
--                                 epoch (set when this state was created: missing after Redis lost it)
--   <tag>:replicas          zset  replica -> heartbeat expiry
--   <tag>:seq               counter for ticket and lease ids
--   <tag>:pins              hash  sequence key -> "<until>|<backend url>": the backend its requests
--                                 take slots on (policies.sequences; gateway/queues/memory/pins.py)
--   <tag>:pinned:<band>     list  ids of pinned tickets (a sequence's requests), in arrival order:
--                                 each waits for its backend's slot apart from the flows, so that a
--                                 busy backend holds back no request behind it
--   <tag>:grants:<r>        list  grants for replica r: JSON {t: [ticket ids], l: lease, u: url, c: cost, b: band},
--                                 or a displaced ticket: {d: ticket id, o: 1 when overdue, else at the cap}
--   <tag>:held:<r>          set   leases held by replica r
--   <tag>:posted            hash  lease id -> the grant pushed onto its replica's list, until the lease
--                                 is freed (recover.lua: a grant popped by a BLMPOP whose reply was lost)
--   <tag>:waiting:<r>       set   tickets queued by replica r
-- Time is Redis's own (TIME), so every replica orders and expires by the same clock; a test may
-- pass its own as A.now.

local tag = KEYS[1]
local A = cjson.decode(ARGV[1])

local function now_s()
  if A.now then return tonumber(A.now) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function fmt(x)
  return string.format('%.6f', x)
end

local function stat(field)
  return tonumber(redis.call('HGET', tag .. ':stats', field) or '0')
end

-- For a while after this state was created (Redis lost what it held, or the first replica ever
-- joined), replicas Redis does not know may still run requests it forgot on their fallback's share
-- of each backend: the expected replicas neither live nor reserved for count with a share each, so
-- the shared count stays an upper bound.
local absent_cache = nil
local function absent_replicas()
  if absent_cache == nil then
    local now = now_s()
    absent_cache = 0
    if now < stat('recovery_until') then
      local expected = tonumber(redis.call('HGET', tag .. ':stats', 'replicas_expected') or '1')
      local live = redis.call('ZCOUNT', tag .. ':replicas', '(' .. fmt(now), '+inf')
      local reserved = redis.call('ZCOUNT', tag .. ':absent', '(' .. fmt(now), '+inf')
      local gone = redis.call('ZCOUNT', tag .. ':gone', '(' .. fmt(now), '+inf')
      absent_cache = math.max(0, expected - live - reserved - gone)
    end
  end
  return absent_cache
end

-- After Redis lost what it held, a replica it does not know may still run any part of a backend,
-- as it did before, until it could have rejoined (unknown_until); only then its fallback's share.
local function slots_used(b)
  local used = tonumber(redis.call('HGET', tag .. ':slots', b.url) or '0')
  local absent = absent_replicas()
  if absent > 0 then
    local expected = tonumber(redis.call('HGET', tag .. ':stats', 'replicas_expected') or '1')
    local each = math.max(1, math.floor(b.cap / expected))
    if now_s() < stat('unknown_until') then each = b.cap end
    used = used + absent * each
  end
  return used
end

-- A.backends: {url, cap (max_concurrency), queued (reported queued inside it)} per backend.
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

-- The slots each band holds, from the most urgent.
local function held_by_band(nbands)
  local held = {}
  for band = 0, nbands - 1 do
    held[#held + 1] = tonumber(redis.call('HGET', tag .. ':held_band', band) or '0')
  end
  return held
end

-- policies.reservations.usable_free_slots, here where it must be atomic with the grant: the free
-- slots a request of `band` may take, less what more urgent classes reserve (A.reserved).
local function usable_free(band, backends, nbands)
  local usable = free_slots(backends)
  if A.reserved == nil then return usable end
  local held = held_by_band(nbands)
  local pool = usable
  for _, n in ipairs(held) do pool = pool + n end
  for urgent = 0, band - 1 do
    local reserved = tonumber(A.reserved[urgent + 1] or 0)
    if reserved > 0 then
      local held_below = 0
      for below = urgent + 1, nbands - 1 do held_below = held_below + held[below + 1] end
      usable = math.min(usable, pool - reserved - held_below)
    end
  end
  return math.max(0, usable)
end

-- The least loaded ready backend with a free slot (policies.balancing.pick_backend): share of its
-- slots in use plus what it reports queued inside it; ties go to the first listed.
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

-- Sequences (policies.sequences; the memory store's gateway/queues/memory/pins.py) ----------------

local PIN_IDLE_S = 600  -- policies.sequences.PIN_IDLE_S (tests/unit/test_sequences.py holds them equal)
local PIN_SWEEP_AT = 4096  -- gateway/queues/memory/pins.SWEEP_AT

local function backend_at(backends, url)
  for _, b in ipairs(backends) do
    if b.url == url then return b end
  end
  return nil
end

-- pins.has_room: the backend at `url` is ready and has a slot free.
local function has_room(backends, url)
  local b = backend_at(backends, url)
  return b ~= nil and redis.call('HGET', tag .. ':ready', url) == '1' and slots_used(b) < b.cap
end

-- policies.balancing.least_loaded: the least loaded ready backend, free slot or not.
local function least_loaded(backends)
  local best, best_load = nil, nil
  for _, b in ipairs(backends) do
    if b.cap > 0 and redis.call('HGET', tag .. ':ready', b.url) == '1' then
      local load = (slots_used(b) + b.queued) / b.cap
      if best == nil or load < best_load then best, best_load = b, load end
    end
  end
  return best
end

-- SequencePins.follow: a request of sequence `key` got a slot on `url`; its next ones go there too
-- until PIN_IDLE_S past `seen_at`, or until one `ends` it.
local function follow_sequence(key, ends, url, seen_at)
  local pins = tag .. ':pins'
  if ends then
    redis.call('HDEL', pins, key)
    return
  end
  redis.call('HSET', pins, key, fmt(seen_at + PIN_IDLE_S) .. '|' .. url)
  -- Swept past PIN_SWEEP_AT pins, and after a sweep past twice what it left (stats pin_sweep_at).
  if redis.call('HLEN', pins) >= tonumber(redis.call('HGET', tag .. ':stats', 'pin_sweep_at') or PIN_SWEEP_AT) then
    local flat = redis.call('HGETALL', pins)
    for i = 1, #flat, 2 do
      if tonumber(string.match(flat[i + 1], '^[^|]*')) < seen_at then redis.call('HDEL', pins, flat[i]) end
    end
    redis.call('HSET', tag .. ':stats', 'pin_sweep_at', math.max(PIN_SWEEP_AT, 2 * redis.call('HLEN', pins)))
  end
end

-- SequencePins.backend_of: the backend a request of sequence `seq` ({k: key, s: starts it, e: ends
-- it}) arriving `now` must take a slot on, and whether it is pinned there anew: its pin; or (first
-- request, a start, a pin past its time or to a backend gone or not ready) the least loaded ready
-- backend (nil: none is ready), which pin_admitted pins once the request is admitted.
local function pinned_backend(seq, backends, now)
  local pin = redis.call('HGET', tag .. ':pins', seq.k)
  if pin and not seq.s then
    local until_s, url = string.match(pin, '^([^|]*)|(.*)$')
    if tonumber(until_s) >= now and backend_at(backends, url) ~= nil
        and redis.call('HGET', tag .. ':ready', url) == '1' then
      return url, false
    end
  end
  local best = least_loaded(backends)
  if best == nil then return nil, true end
  return best.url, true
end

-- SequencePins.admitted: a request of `seq` placed on `url` (pinned_backend) was admitted.
local function pin_admitted(seq, url, anew, now)
  if not anew then return end
  if url == nil then
    redis.call('HDEL', tag .. ':pins', seq.k)
    return
  end
  follow_sequence(seq.k, false, url, now)
end

local function queued_total(nbands)
  local total = 0
  for band = 0, nbands - 1 do
    total = total + tonumber(redis.call('HGET', tag .. ':queued', 'n' .. band) or '0')
  end
  return total
end

-- policies.fairness.joining_start: where a request joining `tenant`'s flow of `band` now starts,
-- behind the flow's queued work.
local function joining_start(band, tenant, virtual)
  local queued = tonumber(redis.call('HGET', tag .. ':fwork:' .. band, tenant) or '0')
  local head = redis.call('ZSCORE', tag .. ':flows:' .. band, tenant)
  if head and queued > 0 then
    return tonumber(head) + queued / tonumber(redis.call('HGET', tag .. ':fweight:' .. band, tenant) or '1')
  end
  return math.max(virtual, tonumber(redis.call('HGET', tag .. ':finish:' .. band, tenant)) or 0)
end

-- policies.fairness.work_ahead_in_turn, here where it must be atomic with the insert: the band's
-- queued work handed out before a request of `tenant` joining now, one request's `slack` per flow.
local function turn_ahead(band, tenant, slack)
  local virtual = tonumber(redis.call('GET', tag .. ':vt:' .. band)) or 0
  local own_finish = joining_start(band, tenant, virtual)
  local span = math.max(0, own_finish - virtual)
  local flat = redis.call('HGETALL', tag .. ':fwork:' .. band)
  local ahead = 0
  for i = 1, #flat, 2 do
    local work = tonumber(flat[i + 1])
    if flat[i] == tenant then
      ahead = ahead + work
    else
      local weight = tonumber(redis.call('HGET', tag .. ':fweight:' .. band, flat[i]) or '1')
      ahead = ahead + math.min(work, span * weight + slack)
    end
  end
  return ahead
end

-- policies.fairness.arrivals_in_turn, here where it must be atomic with turn_ahead, which it
-- complements: what the band's other flows will still send ahead of a request of `tenant` joining
-- now, each at most its `reach` (tenant -> work); a flow never admitted weighs 1.
local function arriving_ahead(band, tenant, slack, reach)
  local virtual = tonumber(redis.call('GET', tag .. ':vt:' .. band)) or 0
  local span = math.max(0, joining_start(band, tenant, virtual) - virtual)
  local extra = 0
  for name, most in pairs(reach) do
    if name ~= tenant and most > 0 then
      local weight = tonumber(redis.call('HGET', tag .. ':fweight:' .. band, name) or '1')
      local queued = tonumber(redis.call('HGET', tag .. ':fwork:' .. band, name) or '0')
      local in_turn = span * weight + slack
      extra = extra + math.max(0, math.min(in_turn, queued + most) - math.min(in_turn, queued))
    end
  end
  return extra
end

-- Whether `band` holds fair-queued flows (weights are kept only under FIFO ordering).
local function fair_band(band)
  return redis.call('EXISTS', tag .. ':fwork:' .. band, tag .. ':fweight:' .. band) == 2
end

-- policies.wait.QueueStats.work_ahead: more urgent bands' work, and the own band's up to the
-- request's turn when `tenant` is given (fair queuing) and flows wait in it, else all of it.
local function work_ahead(band, tenant, slack)
  local work = 0
  for b = 0, band do
    if b == band and tenant ~= nil and fair_band(b) then
      work = work + turn_ahead(b, tenant, slack)
    else
      work = work + tonumber(redis.call('HGET', tag .. ':queued', 'w' .. b) or '0')
    end
  end
  return work
end

-- Ids are zero-padded so that equal scores in a zset still order by creation (FIFO).
local function next_id()
  return string.format('%015d', redis.call('INCR', tag .. ':seq'))
end

local function flow_key(band, tenant)
  return tag .. ':q:' .. band .. ':' .. tenant
end

-- The band's flows are ordered by their heads' scores: under EDF, a flow's entry is its head's
-- deadline; in fair queuing, its head's start tag (policies.fairness.head_start), taken when the
-- head changed (`new_head`).
local function refresh_head(band, tenant, new_head)
  local head = redis.call('ZRANGE', flow_key(band, tenant), 0, 0, 'WITHSCORES')
  if #head == 0 then
    redis.call('ZREM', tag .. ':flows:' .. band, tenant)
  elseif redis.call('HEXISTS', tag .. ':fweight:' .. band, tenant) == 0 then
    redis.call('ZADD', tag .. ':flows:' .. band, head[2], tenant)
  elseif new_head then
    local virtual = tonumber(redis.call('GET', tag .. ':vt:' .. band)) or 0
    local finish = tonumber(redis.call('HGET', tag .. ':finish:' .. band, tenant)) or 0
    redis.call('ZADD', tag .. ':flows:' .. band, string.format('%.17g', math.max(virtual, finish)), tenant)
  end
end

local function count_queued(info, sign)
  local n = redis.call('HINCRBY', tag .. ':queued', 'n' .. info.b, sign)
  if info.p then redis.call('HINCRBY', tag .. ':queued', 'p' .. info.b, sign) end
  local fwork = tag .. ':fwork:' .. info.b
  if n <= 0 then
    redis.call('HSET', tag .. ':queued', 'n' .. info.b, 0, 'w' .. info.b, 0, 'p' .. info.b, 0)  -- no float residue
    redis.call('DEL', fwork)
  else
    redis.call('HINCRBYFLOAT', tag .. ':queued', 'w' .. info.b, sign * info.c)
    local left = tonumber(redis.call('HINCRBYFLOAT', fwork, info.t, sign * info.c))
    if left <= 1e-9 * math.max(1, info.c) then redis.call('HDEL', fwork, info.t) end
  end
end

-- A request of `tenant`'s fair-queued flow of `band` is admitted with `weight`, which counts its
-- flow's work in the others' turns from now on; a queued head takes its start tag as it becomes
-- the head (refresh_head).
local function join_fair_flow(band, tenant, weight)
  redis.call('HSET', tag .. ':fweight:' .. band, tenant, string.format('%.17g', weight))
end

-- QueueStats.only_pinned_ahead: every ticket waiting in `band` and the more urgent ones is pinned.
local function only_pinned_ahead(band)
  for b = 0, band do
    local queued = redis.call('HMGET', tag .. ':queued', 'n' .. b, 'p' .. b)
    if tonumber(queued[1] or '0') ~= tonumber(queued[2] or '0') then return false end
  end
  return true
end

local function pinned_key(band)
  return tag .. ':pinned:' .. band
end

-- A pinned ticket (info.p) counts in its band's and flow's queued work but waits apart, never a
-- flow's head (gateway/queues/memory/model_queue.insert).
local function enqueue(id, info, score)
  redis.call('HSET', tag .. ':tickets', id, cjson.encode(info))
  redis.call('SADD', tag .. ':waiting:' .. info.r, id)
  count_queued(info, 1)
  if info.p then
    redis.call('RPUSH', pinned_key(info.b), id)
    return
  end
  redis.call('ZADD', flow_key(info.b, info.t), score, id)
  refresh_head(info.b, info.t, redis.call('ZCARD', flow_key(info.b, info.t)) == 1)
end

-- Forget a ticket that left its flow's zset (popped by the caller, or removed here).
local function forget_ticket(id, info)
  redis.call('HDEL', tag .. ':tickets', id)
  redis.call('SREM', tag .. ':waiting:' .. info.r, id)
  count_queued(info, -1)
end

local function ticket_info(id)
  local raw = redis.call('HGET', tag .. ':tickets', id)
  if raw then return cjson.decode(raw) end
  return nil
end

-- Take a queued ticket out of its queue; false when it was not queued (granted, or purged).
local function unqueue(id)
  local info = ticket_info(id)
  if info == nil then return false end
  if info.p then
    redis.call('LREM', pinned_key(info.b), 1, id)
    forget_ticket(id, info)
    return true
  end
  local was_head = redis.call('ZRANK', flow_key(info.b, info.t), id) == 0
  redis.call('ZREM', flow_key(info.b, info.t), id)
  forget_ticket(id, info)
  refresh_head(info.b, info.t, was_head)
  return true
end

-- A.bound_s: how long the request a lease covers may run at most (the caller's upstream timeout
-- and a margin), so that a lease outlives no work and no work outlives its lease.
-- `band`: whose reservations the slot counts against (policies.reservations).
-- Work granted slots per flow, for the tenants' shares: HINCRBYFLOAT on "<band>:<tenant>".
local function count_granted(band, tenant, cost)
  redis.call('HINCRBYFLOAT', tag .. ':granted', band .. ':' .. tenant, cost)
end

local function grant_lease(url, replica, ttl, now, band, tenant, cost, kind)
  local lease = next_id()
  if kind ~= nil and kind ~= '' then redis.call('HSET', tag .. ':lease_kind', lease, kind) end
  redis.call('HINCRBY', tag .. ':slots', url, 1)
  redis.call('HSET', tag .. ':lease_band', lease, band)
  redis.call('HINCRBY', tag .. ':held_band', band, 1)
  redis.call('HSET', tag .. ':lease_tenant', lease, cjson.encode({t = tenant, c = cost}))
  redis.call('HINCRBYFLOAT', tag .. ':tenant_held', tenant, cost)
  redis.call('ZADD', tag .. ':leases', now + ttl, lease)
  redis.call('HSET', tag .. ':lease', lease, url .. '|' .. replica)
  redis.call('HSET', tag .. ':bound', lease, fmt(now + A.bound_s))
  redis.call('ZADD', tag .. ':started', now, lease)
  redis.call('SADD', tag .. ':held:' .. replica, lease)
  return lease
end

local function lease_owner(lease)
  local info = redis.call('HGET', tag .. ':lease', lease)
  if not info then return nil end
  local _, replica = string.match(info, '^(.*)|([^|]*)$')
  return replica
end

-- Free a lease's slot; false when it was already freed (release is idempotent).
local function free_lease(lease)
  local info = redis.call('HGET', tag .. ':lease', lease)
  if not info then return false end
  local url, replica = string.match(info, '^(.*)|([^|]*)$')
  local owner = redis.call('HGET', tag .. ':lease_tenant', lease)
  if owner then
    owner = cjson.decode(owner)
    redis.call('HDEL', tag .. ':lease_tenant', lease)
    if tonumber(redis.call('HINCRBYFLOAT', tag .. ':tenant_held', owner.t, -owner.c)) < 1e-9 then
      redis.call('HDEL', tag .. ':tenant_held', owner.t)
    end
  end
  local band = redis.call('HGET', tag .. ':lease_band', lease)
  if band then
    redis.call('HDEL', tag .. ':lease_band', lease)
    if tonumber(redis.call('HINCRBY', tag .. ':held_band', band, -1)) < 0 then
      redis.call('HSET', tag .. ':held_band', band, 0)
    end
  end
  redis.call('HDEL', tag .. ':lease', lease)
  redis.call('HDEL', tag .. ':bound', lease)
  redis.call('HDEL', tag .. ':lease_kind', lease)
  redis.call('HDEL', tag .. ':posted', lease)
  redis.call('ZREM', tag .. ':started', lease)
  redis.call('ZREM', tag .. ':leases', lease)
  redis.call('SREM', tag .. ':held:' .. replica, lease)
  if tonumber(redis.call('HINCRBY', tag .. ':slots', url, -1)) < 0 then
    redis.call('HSET', tag .. ':slots', url, 0)
  end
  return true
end

-- What a replica's beat (or join) records of how long its leases would stay reserved.
local function hold_entry(now)
  local share = {}
  for _, entry in ipairs(A.share) do share[entry.u] = entry.n end
  local hold_until = 0
  if A.hold_s > 0 then hold_until = now + A.hold_s end
  return cjson.encode({t = fmt(hold_until), s = share})
end

-- What the others know of this replica's process: the config it runs (the status page) and, with a
-- beacon, where to probe it once it is absent (peers.lua, gone.lua).
local function publish_peer(replica)
  if A.peer then
    redis.call('HSET', tag .. ':peer', replica, cjson.encode(A.peer))
  else
    redis.call('HDEL', tag .. ':peer', replica)
  end
end

-- A replica is live while its heartbeat has not lapsed; one that is not may be cut off and
-- serving from its fallback on the capacity of its leases, so they are not its to free or renew.
local function live(replica, now)
  local expiry = redis.call('ZSCORE', tag .. ':replicas', replica)
  if not expiry then return false end
  return tonumber(expiry) > now
end

-- The leases of grants pushed to a replica that it has not taken from its list.
local function undelivered(replica)
  local leases = {}
  for _, raw in ipairs(redis.call('LRANGE', tag .. ':grants:' .. replica, 0, -1)) do
    local entry = cjson.decode(raw)
    if entry.l then leases[entry.l] = true end  -- not a displaced ticket's {d = id}
  end
  return leases
end

-- A replica whose heartbeat lapsed may be partitioned and still running requests (its own, and
-- what its fallback started on their capacity), or dead while a backend computes on: each lease
-- it holds stays reserved until the work's bound, and up to its fallback's share of each backend
-- also until its hold. Grants it never took are freed, its queued tickets dropped (their clients
-- are not waiting here).
local function reserve_absent(replica, now)
  local raw = redis.call('HGET', tag .. ':hold', replica)
  local hold = raw and cjson.decode(raw) or {t = 0, s = {}}
  local untaken = undelivered(replica)
  local reserved_until, for_fallback = 0, {}
  for _, lease in ipairs(redis.call('SMEMBERS', tag .. ':held:' .. replica)) do
    if untaken[lease] then
      free_lease(lease)
    else
      local ends = tonumber(redis.call('HGET', tag .. ':bound', lease) or '0')
      -- Its fallback reuses up to its share of a backend: that many are held for its time too.
      local url = string.match(redis.call('HGET', tag .. ':lease', lease) or '', '^(.*)|[^|]*$')
      if url and (for_fallback[url] or 0) < tonumber(hold.s[url] or 0) then
        for_fallback[url] = (for_fallback[url] or 0) + 1
        ends = math.max(ends, tonumber(hold.t))
      end
      if ends <= now then
        free_lease(lease)
      else
        redis.call('ZADD', tag .. ':leases', ends, lease)
        reserved_until = math.max(reserved_until, ends)
      end
    end
  end
  for _, id in ipairs(redis.call('SMEMBERS', tag .. ':waiting:' .. replica)) do unqueue(id) end
  redis.call('DEL', tag .. ':waiting:' .. replica, tag .. ':grants:' .. replica)
  redis.call('ZREM', tag .. ':replicas', replica)
  redis.call('HDEL', tag .. ':hold', replica)
  if reserved_until > now then
    redis.call('ZADD', tag .. ':absent', reserved_until, replica)
  else
    redis.call('HDEL', tag .. ':peer', replica)
  end
end

-- Absent replicas whose reservations have ended are forgotten.
local function forget_absent(now)
  local ended = redis.call('ZRANGEBYSCORE', tag .. ':absent', '-inf', now)
  if #ended > 0 then
    redis.call('HDEL', tag .. ':peer', unpack(ended))
    redis.call('ZREMRANGEBYSCORE', tag .. ':absent', '-inf', now)
  end
end

-- Replicas whose heartbeat lapsed, reserved before any slot is handed out (see reserve_absent).
local function reap_absent(now)
  local lapsed = redis.call('ZRANGEBYSCORE', tag .. ':replicas', '-inf', now)
  for _, replica in ipairs(lapsed) do reserve_absent(replica, now) end
  return #lapsed
end

-- Room for `cost` more work of `band` under the model's queue cap (A.cap), displacing queued work of
-- less urgent bands if that makes it fit, in policies.displacement.cap_victims' order (the least
-- urgent band first, borrowers before owners, the newest first), as the memory store's
-- ModelQueue.room_for does; nothing is displaced when even that would not. Each victim's replica
-- is told through its list: {d = ticket id}.
local function room_for(band, cost, nbands)
  local queued = 0
  for b = 0, nbands - 1 do queued = queued + tonumber(redis.call('HGET', tag .. ':queued', 'w' .. b) or '0') end
  local excess = queued + cost - A.cap
  if excess <= 0 then return true end
  local victims = {}
  for b = nbands - 1, band + 1, -1 do
    local entries = {}
    for _, tenant in ipairs(redis.call('ZRANGE', tag .. ':flows:' .. b, 0, -1)) do
      local borrower = A.quotas ~= nil and A.quotas[tenant] == nil
      local items = redis.call('ZRANGE', flow_key(b, tenant), 0, -1, 'WITHSCORES')
      for i = 1, #items, 2 do
        entries[#entries + 1] = {id = items[i], s = tonumber(items[i + 1]), o = borrower}
      end
    end
    table.sort(entries, function(x, y)
      if x.o ~= y.o then return x.o end  -- borrowers' work goes before owners'
      if x.s ~= y.s then return x.s > y.s end
      return x.id > y.id
    end)
    for _, entry in ipairs(entries) do
      if excess <= 0 then break end
      local info = ticket_info(entry.id)
      victims[#victims + 1] = {entry.id, info.r}
      excess = excess - info.c
    end
    if excess <= 0 then break end
  end
  if excess > 0 then return false end
  for _, victim in ipairs(victims) do
    unqueue(victim[1])
    redis.call('RPUSH', tag .. ':grants:' .. victim[2], cjson.encode({d = victim[1]}))
  end
  return true
end

-- policies.quotas.may_start, here where it must be atomic with the grant. A.quotas: tenant ->
-- {n = nominal, b = borrowing limit, l = lending limit} (b, l absent: no limit).
local function tenant_inflight()
  local flat = redis.call('HGETALL', tag .. ':tenant_held')
  local inflight = {}
  for i = 1, #flat, 2 do inflight[flat[i]] = tonumber(flat[i + 1]) end
  return inflight
end

local function borrowed_of(tenant, running)
  local quota = A.quotas[tenant]
  return math.max(0, running - (quota and quota.n or 0))
end

local function head_cost(band, tenant)
  local head = redis.call('ZRANGE', flow_key(band, tenant), 0, 0)
  if #head == 0 then return nil end
  return ticket_info(head[1]).c
end

-- A tenant whose queued head would run within its quota waits: no new borrowing starts.
local function owner_waiting(nbands, inflight)
  for band = 0, nbands - 1 do
    for _, tenant in ipairs(redis.call('ZRANGE', tag .. ':flows:' .. band, 0, -1)) do
      local quota = A.quotas[tenant]
      if quota then
        local cost = head_cost(band, tenant)
        if cost and (inflight[tenant] or 0) + cost <= quota.n then return true end
      end
    end
  end
  return false
end

local function may_start(tenant, cost, backends, nbands)
  if A.quotas == nil then return true end
  local inflight = tenant_inflight()
  local quota = A.quotas[tenant]
  local running = inflight[tenant] or 0
  if quota and running + cost <= quota.n then return true end
  if owner_waiting(nbands, inflight) then return false end
  inflight[tenant] = running + cost
  if quota and quota.b and borrowed_of(tenant, inflight[tenant]) > quota.b then return false end
  local slots = free_slots(backends)
  for _, n in ipairs(held_by_band(nbands)) do slots = slots + n end
  local capacity = slots * math.max(A.per_slot or 1, cost)  -- policies.quotas.work_capacity
  local owned, unused = 0, 0
  for owner, q in pairs(A.quotas) do
    owned = owned + q.n
    unused = unused + math.min(q.l or math.huge, math.max(0, q.n - (inflight[owner] or 0)))
  end
  local total = 0
  for name, work in pairs(inflight) do total = total + borrowed_of(name, work) end
  return total <= math.max(0, capacity - owned) + unused
end

-- policies.admission.most_within: the largest n with n + spread * sqrt(n) <= budget.
local function most_within(budget, spread)
  if spread == 0 then return budget end
  local root = 2 * budget / (spread + math.sqrt(spread * spread + 4 * budget))
  return root * root
end

-- policies.displacement.overdue, here where it must be atomic with the insert that caused it.
-- A.drain: the pool's hand-overs per second while busy; A.service_cv: its service times'
-- coefficient of variation; `ahead`: the hand-overs ahead.
local function overdue(now, leave_by, ahead)
  if leave_by == nil then return false end
  local left = leave_by - now
  if left <= 0 then return true end
  return ahead + 1 > most_within(A.drain * left, A.overdue_sigmas * A.service_cv)
end

-- policies.displacement.owners_ahead: per band b (at b + 1), the owners' queued requests in bands b
-- and less urgent that will run within their quotas, their work taken most urgent first and each
-- band's share of it counted in that band's requests at their mean cost.
local function owners_ahead(nbands)
  local inflight, ahead = tenant_inflight(), {}
  for b = 1, nbands do ahead[b] = 0 end
  for owner, quota in pairs(A.quotas) do
    local room, before = math.max(0, quota.n - (inflight[owner] or 0)), 0
    for b = 0, nbands - 1 do
      local work = tonumber(redis.call('HGET', tag .. ':fwork:' .. b, owner) or '0')
      local within = math.max(0, math.min(room, before + work) - math.min(room, before))
      if work > 0 then
        local runs = within / work * redis.call('ZCARD', flow_key(b, owner))
        for counted = 1, b + 1 do ahead[counted] = ahead[counted] + runs end
      end
      before = before + work
    end
  end
  return ahead
end

-- policies.displacement.overdue_in_flow over each flow of the bands less urgent than `band` (and,
-- on an owner's arrival that `reclaim`s its quota, over the borrowers' flows of every band, with
-- the owners' requests ahead of them), counted in requests (a batch's hand-over carries up to its
-- max of them): the newest A.overdue_checked tickets of each that can no longer
-- get a slot by their leave-by time are displaced, each victim told through its replica's list:
-- {d = ticket id, o = 1} (as the memory store's ModelQueue.displace_overdue does).
local function displace_overdue(band, nbands, now, reclaim)
  local owners = nil
  if A.quotas ~= nil then owners = owners_ahead(nbands) end
  local urgent = 0
  for b = 0, nbands - 1 do
    if b > band or reclaim then
      for _, tenant in ipairs(redis.call('ZRANGE', tag .. ':flows:' .. b, 0, -1)) do
        local borrower = owners ~= nil and A.quotas[tenant] == nil
        if b > band or borrower then
          local flow_requests = redis.call('ZCARD', flow_key(b, tenant))
          local base = urgent
          if borrower then base = base + owners[b + 1] end
          local victims = {}
          local newest = redis.call('ZREVRANGE', flow_key(b, tenant), 0, A.overdue_checked - 1)
          for position, id in ipairs(newest) do
            local info = ticket_info(id)
            local ahead = base
            if not A.edf then ahead = ahead + math.max(0, flow_requests - position) end
            ahead = ahead / math.max(1, math.floor(info.m or 1))  -- requests_per_handover
            if overdue(now, tonumber(info.e), ahead) then victims[#victims + 1] = {id, info.r} end
          end
          for _, victim in ipairs(victims) do
            unqueue(victim[1])
            redis.call('RPUSH', tag .. ':grants:' .. victim[2], cjson.encode({d = victim[1], o = 1}))
          end
        end
      end
    end
    urgent = urgent + tonumber(redis.call('HGET', tag .. ':queued', 'n' .. b) or '0')
  end
end

-- With quotas, the band's flow that goes next: the first by head score (ties: the earlier head)
-- whose tenant may start now; nil when none may.
local function startable_flow(band, backends, nbands)
  local flows = redis.call('ZRANGE', tag .. ':flows:' .. band, 0, -1, 'WITHSCORES')
  local candidates = {}
  for i = 1, #flows, 2 do
    local head = redis.call('ZRANGE', flow_key(band, flows[i]), 0, 0)
    if #head > 0 then
      candidates[#candidates + 1] = {t = flows[i], s = tonumber(flows[i + 1]), h = head[1]}
    end
  end
  table.sort(candidates, function(x, y)
    if x.s ~= y.s then return x.s < y.s end
    return x.h < y.h
  end)
  for _, candidate in ipairs(candidates) do
    if may_start(candidate.t, ticket_info(candidate.h).c, backends, nbands) then return candidate.t end
  end
  return nil
end

-- pins.next_pinned: the first waiting request of a sequence, most urgent band first, whose backend
-- has a slot free, that its band may take (reservations) and its tenant may start (quotas).
-- Returns its band, id and info; nil if none.
local function next_pinned(nbands, backends)
  for band = 0, nbands - 1 do
    local ids = redis.call('LRANGE', pinned_key(band), 0, -1)
    if #ids > 0 then
      -- Kept for a more urgent class, and so from every less urgent one.
      if usable_free(band, backends, nbands) <= 0 then return nil end
      for _, id in ipairs(ids) do
        local info = ticket_info(id)
        if has_room(backends, info.p) and may_start(info.t, info.c, backends, nbands) then
          return band, id, info
        end
      end
    end
  end
  return nil
end

-- The next tickets to get a slot: the head of the flow with the lowest head score in the most
-- urgent band with work (before band `before`, where given), and the tickets right behind it in
-- its flow that share its batch key (same replica: the bodies are there), up to its batch cost.
-- Returns ids, info of the head, cost.
local function take_next(nbands, backends, before)
  for band = 0, (before or nbands) - 1 do
    while true do
      local first = redis.call('ZRANGE', tag .. ':flows:' .. band, 0, 0, 'WITHSCORES')
      if #first == 0 then break end
      -- Kept for a more urgent class, and so from every less urgent one.
      if A.reserved ~= nil and usable_free(band, backends, nbands) <= 0 then return nil end
      local tenant = first[1]
      local held_back = false
      if A.quotas ~= nil then
        tenant = startable_flow(band, backends, nbands)
        held_back = tenant == nil
      end
      -- Flows whose heads tie go in the order their heads were queued (as the memory store does),
      -- not by the tenants' names.
      local tied = {}
      if A.quotas == nil then tied = redis.call('ZRANGEBYSCORE', tag .. ':flows:' .. band, first[2], first[2]) end
      if held_back then break end  -- held back by quotas: a less urgent band may take the slot
      if #tied > 1 then
        local earliest = nil
        for _, candidate in ipairs(tied) do
          local head = redis.call('ZRANGE', flow_key(band, candidate), 0, 0)
          if #head > 0 and (earliest == nil or head[1] < earliest) then earliest, tenant = head[1], candidate end
        end
      end
      local key = flow_key(band, tenant)
      local start = redis.call('ZSCORE', tag .. ':flows:' .. band, tenant)
      local popped = redis.call('ZPOPMIN', key)
      if #popped > 0 then
        local id = popped[1]
        -- policies.fairness.virtual_time_after: the clock never goes back.
        local virtual = tonumber(redis.call('GET', tag .. ':vt:' .. band)) or 0
        if tonumber(start) > virtual then redis.call('SET', tag .. ':vt:' .. band, start) end
        local info = ticket_info(id)
        forget_ticket(id, info)
        local ids, cost, costs = {id}, info.c, {info.c}
        if info.k then
          while true do
            local behind = redis.call('ZRANGE', key, 0, 0)
            if #behind == 0 then break end
            local next_info = ticket_info(behind[1])
            if next_info.k ~= info.k or next_info.r ~= info.r or cost + next_info.c > info.m then break end
            redis.call('ZREM', key, behind[1])
            forget_ticket(behind[1], next_info)
            ids[#ids + 1] = behind[1]
            costs[#costs + 1] = next_info.c
            cost = cost + next_info.c
          end
        end
        local weight = redis.call('HGET', tag .. ':fweight:' .. band, tenant)
        if weight then
          -- policies.fairness.finish_after, for the head and each follower of its batch.
          local finish = tonumber(start)
          for _, handed in ipairs(costs) do
            finish = finish + math.min(math.max(handed, 0), 1e9) / tonumber(weight)  -- TAG_COST_MAX
          end
          redis.call('HSET', tag .. ':finish:' .. band, tenant, string.format('%.17g', finish))
        end
        refresh_head(band, tenant, true)
        return ids, info, cost
      end
      redis.call('ZREM', tag .. ':flows:' .. band, tenant)  -- an empty flow's stale entry
    end
  end
  return nil
end

-- Hand free slots to waiting tickets (policies.dispatch: strict priority, then the flow's head).
-- `drain_sample`: one slot just freed, so a hand-over under backlog counts its work and the gap
-- since the last one into the drain counters. Grants go onto their replica's list, except those
-- for `caller`, which are returned: that replica delivers them itself, without a trip through
-- its list.
local function dispatch(nbands, backends, ttl, now, drain_sample, caller)
  reap_absent(now)
  local granted, mine = 0, {}
  -- Only the freed slot's hand-over is a drain sample: others in the same dispatch go to slots
  -- that were free already (held for a batch).
  local sample = drain_sample
  while true do
    local backend = pick_backend(backends)
    if backend == nil then break end
    -- policies.dispatch.pinned_goes_first: a sequence's request whose backend has a slot free goes
    -- before the flows of its band and the less urgent ones.
    local pinned_band, pinned_id, pinned_info = next_pinned(nbands, backends)
    local ids, info, cost = take_next(nbands, backends, pinned_band)
    if ids == nil and pinned_band ~= nil then
      redis.call('LREM', pinned_key(pinned_band), 1, pinned_id)
      forget_ticket(pinned_id, pinned_info)
      ids, info, cost = {pinned_id}, pinned_info, pinned_info.c
      backend = backend_at(backends, pinned_info.p)
    end
    if ids == nil then break end
    if info.s then follow_sequence(info.s, info.x == 1, backend.url, tonumber(info.e)) end
    -- A batch of several serves no one kind.
    local kind = nil
    if #ids == 1 then kind = info.q end
    local lease = grant_lease(backend.url, info.r, ttl, now, info.b, info.t, cost, kind)
    count_granted(info.b, info.t, cost)
    local grant = cjson.encode({t = ids, l = lease, u = backend.url, c = cost, b = info.b, q = kind})
    if info.r == caller then
      mine[#mine + 1] = grant
    else
      redis.call('RPUSH', tag .. ':grants:' .. info.r, grant)
      redis.call('HSET', tag .. ':posted', lease, grant)
    end
    granted = granted + 1
    redis.call('HINCRBY', tag .. ':stats', 'handovers', 1)
    redis.call('HINCRBYFLOAT', tag .. ':stats', 'handed_work', cost)
    if sample then
      sample = false
      local last = redis.call('HGET', tag .. ':stats', 'backlog_at')
      if last then
        redis.call('HINCRBYFLOAT', tag .. ':stats', 'drained_work', cost)
        redis.call('HINCRBYFLOAT', tag .. ':stats', 'drained_s', math.max(0, now - tonumber(last)))
        redis.call('HSET', tag .. ':stats', 'drained_at', fmt(now))
      end
    end
  end
  -- Mark a hand-over that left requests waiting: the gap to the next one is a clean drain sample.
  local total = queued_total(nbands)
  if total > 0 and drain_sample and granted > 0 then
    redis.call('HSET', tag .. ':stats', 'backlog_at', fmt(now))
  elseif total == 0 or granted > 0 then
    redis.call('HDEL', tag .. ':stats', 'backlog_at')
  end
  return granted, mine
end

-- Arrivals a replica refused on its own (from a fresh view, without a round trip) still count
-- as offered work: A.refused holds their work per band.
local function count_refused_locally(nbands)
  if A.refused == nil then return end
  for band = 0, nbands - 1 do
    local work = tonumber(A.refused[band + 1] or 0)
    if work > 0 then redis.call('HINCRBYFLOAT', tag .. ':stats', 'off:' .. band, work) end
  end
end

-- What admission, metrics and the estimators need (gateway/queues/redis/codec.py: View).
-- When each slot in use was handed over, and the kind of request it serves ('' where not told): the
-- ages of the work in flight, and which service times to read their residuals from, for admission.
-- The leases Redis holds for absent replicas (reserve_absent): slots no request gets back before
-- their reservations end, however long their work has run.
local function reserved_for_absent()
  local reserved = {}
  for _, replica in ipairs(redis.call('ZRANGE', tag .. ':absent', 0, -1)) do
    for _, lease in ipairs(redis.call('SMEMBERS', tag .. ':held:' .. replica)) do reserved[lease] = true end
  end
  return reserved
end

-- The grant times (and kinds) of the requests running on the pool's slots, and how many slots
-- absent replicas' reservations hold: admission reads the running ones' ages as work that ends
-- by its service times, which a reservation does not.
local function started_times()
  local reserved, held_absent = reserved_for_absent(), 0
  local started = redis.call('ZRANGE', tag .. ':started', 0, -1, 'WITHSCORES')
  local times, leases, kinds = {}, {}, {}
  for i = 2, #started, 2 do
    if reserved[started[i - 1]] then
      held_absent = held_absent + 1
    else
      times[#times + 1] = started[i]
      leases[#leases + 1] = started[i - 1]
    end
  end
  if #leases > 0 then
    for i, kind in ipairs(redis.call('HMGET', tag .. ':lease_kind', unpack(leases))) do
      kinds[i] = kind or ''
    end
  end
  return times, kinds, held_absent
end

-- A fair-queued band's state (policies.fairness.FairTurns) while flows wait in it, else 0; sent
-- only where requests come in tenants' flows (A.tenants): with one flow a turn is the whole band.
local function fair_turns(band)
  if not fair_band(band) then return 0 end
  local virtual = tonumber(redis.call('GET', tag .. ':vt:' .. band)) or 0
  local starts = {}
  for _, tenant in ipairs(redis.call('HKEYS', tag .. ':fweight:' .. band)) do
    starts[#starts + 1] = tenant
    starts[#starts + 1] = string.format('%.17g', joining_start(band, tenant, virtual))
  end
  return {
    redis.call('GET', tag .. ':vt:' .. band) or '0',
    starts,
    redis.call('HGETALL', tag .. ':fwork:' .. band),
    redis.call('HGETALL', tag .. ':fweight:' .. band),
  }
end

-- The grant times of the work in flight cost a read (and a reply) lease by lease: with more than
-- LEASES_ALWAYS_SENT in flight they are left out where the caller's own are fresh (A.fresh, a few
-- milliseconds old); it keeps those (gateway/queues/redis/codec.py, View.parse).
local LEASES_ALWAYS_SENT = 64

local function view(nbands, backends, now)
  local n, w, p, off, adm, ft = {}, {}, {}, {}, {}, {}
  local started, kinds, held_absent = nil, nil, nil
  if not A.fresh or redis.call('ZCARD', tag .. ':started') <= LEASES_ALWAYS_SENT then
    started, kinds, held_absent = started_times()
  end
  for band = 0, nbands - 1 do
    n[#n + 1] = tonumber(redis.call('HGET', tag .. ':queued', 'n' .. band) or '0')
    w[#w + 1] = tonumber(redis.call('HGET', tag .. ':queued', 'w' .. band) or '0')
    p[#p + 1] = tonumber(redis.call('HGET', tag .. ':queued', 'p' .. band) or '0')
    off[#off + 1] = stat('off:' .. band)
    adm[#adm + 1] = stat('adm:' .. band)
    if A.tenants then ft[#ft + 1] = fair_turns(band) end
  end
  return {
    now = fmt(now), free = free_slots(backends), ib = held_by_band(nbands), n = n, w = w, p = p, off = off,
    adm = adm,
    ft = ft,
    dw = stat('drained_work'), ds = stat('drained_s'),
    da = redis.call('HGET', tag .. ':stats', 'drained_at') or '',
    h = stat('handovers'), hw = stat('handed_work'), st = started, sk = kinds, ra = held_absent,
    g = redis.call('HGETALL', tag .. ':granted'),
    a = redis.call('HGETALL', tag .. ':admitted'),
    th = redis.call('HGETALL', tag .. ':tenant_held'),
  }
end

-- This state was written on one Redis process; on another (a replica Sentinel or Cluster promoted,
-- a restart from a snapshot or an append-only file) the last writes before the switch may be
-- missing: a lease granted on the old master and never replicated would leave a slot counted
-- free while its request runs. So a state found on another process than it was written on is
-- dropped whole, before any script reads it, and the replicas rejoin it as after a Redis that lost
-- its state (their rejoin counts again the work they still run, and presumes for a TTL that the
-- others run all of each backend until they have rejoined too).
local function forget_state()
  local pattern = string.gsub(tag, '([%*%?%[%]\\])', '\\%1') .. ':*'
  local cursor = '0'
  repeat
    local reply = redis.call('SCAN', cursor, 'MATCH', pattern, 'COUNT', 1000)
    cursor = reply[1]
    if #reply[2] > 0 then redis.call('DEL', unpack(reply[2])) end
  until cursor == '0'
end

local server = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
local written_on = redis.call('GET', tag .. ':server')
if written_on ~= server then
  if written_on then forget_state() end  -- none yet: a new state, or one from before this check
  redis.call('SET', tag .. ':server', server)
end
