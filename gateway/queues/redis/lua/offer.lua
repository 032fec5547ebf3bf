-- Admission check and insert in one step: grant a free slot, queue, or refuse.
-- A: replica, band, tenant, cost, max_work, handover (the replica's estimate of the work a
--    hand-over takes), bands, edf, weight (the tenant's, in fair queuing), allowed_s, ttl, refused,
--    backends, bound_s, reserved, quotas, batch ({key, max, hold?} or absent), drain, overdue_sigmas and
--    overdue_checked (absent: no displacement of overdue work), kind (the request's, or ''), reach
--    (tenant -> the most work it may send within allowed_s: policies.admission.offer_reach), seq (its
--    sequence, {k: key, s: true when it starts it, e: true when it ends it}, or absent), now (tests).
-- A sequence's request is pinned on arrival to its sequence's backend (policies.sequences): it is
-- granted at once only with a slot free there, and otherwise waits apart for one (dispatch).
-- The check (gateway/queues/base.RequestQueue.offer): refuse when the work queued ahead of it in
-- its band (up to its flow's turn) and the more urgent ones, what of the other flows' reach goes
-- ahead of its turn, and the room it takes (its cost behind queued work, else one hand-over)
-- exceed max_work (none with a slot free and nothing queued ahead); a negative limit refuses even then.
-- A replica whose heartbeat lapsed takes nothing: it must rejoin first (rejoin.lua).
-- At the model's queue cap (A.cap) it displaces the newest queued work of less urgent bands, each
-- victim told through its replica's list ({d = ticket id}), or is refused with cap = true.
-- Returns {kind = 'granted', lease, url, view} | {kind = 'queued', ticket, view} | {kind = 'full', view}
--       | {kind = 'absent'}.
local now = now_s()
if not live(A.replica, now) then return cjson.encode({kind = 'absent'}) end
reap_absent(now)
local nbands = A.bands
local pinned, anew = nil, false  -- the backend a sequence's request must take its slot on
if A.seq ~= nil then pinned, anew = pinned_backend(A.seq, A.backends, now) end
count_refused_locally(nbands)
redis.call('HINCRBYFLOAT', tag .. ':stats', 'off:' .. A.band, A.cost)
local turn_of = nil  -- under EDF a band is not fair-queued: its whole work is ahead
if not A.edf then turn_of = A.tenant end
local ahead = work_ahead(A.band, turn_of, A.handover)
local free = usable_free(A.band, A.backends, nbands)
-- policies.wait.queued_ahead: pinned requests ahead wait for their own backends, which are full.
if ahead > 0 and free > 0 and only_pinned_ahead(A.band) then ahead = 0 end
-- policies.wait.work_before_grant (and room_taken), here where it must be atomic with the insert;
-- the other flows' arrivals ahead of its turn (A.reach) count only where it waits.
local to_drain = 0
if ahead > 0 or free == 0 then
  if turn_of ~= nil and A.reach ~= nil and next(A.reach) ~= nil and fair_band(A.band) then
    to_drain = arriving_ahead(A.band, turn_of, A.handover, A.reach)
  end
  if ahead > 0 then to_drain = to_drain + ahead + math.max(A.handover, A.cost)
  else to_drain = to_drain + A.handover end
end
if to_drain > A.max_work then
  return cjson.encode({kind = 'full', view = view(nbands, A.backends, now)})
end
local immediate = to_drain == 0 and may_start(A.tenant, A.cost, A.backends, nbands)
  and (pinned == nil or has_room(A.backends, pinned))
if not immediate and A.cap ~= nil and not room_for(A.band, A.cost, nbands) then
  return cjson.encode({kind = 'full', cap = true, view = view(nbands, A.backends, now)})
end
if A.seq ~= nil then pin_admitted(A.seq, pinned, anew, now) end
redis.call('HINCRBYFLOAT', tag .. ':stats', 'adm:' .. A.band, A.cost)
redis.call('HINCRBYFLOAT', tag .. ':admitted', A.band .. ':' .. A.tenant, A.cost)
-- Under fair queuing its flow's weight counts in the others' turns from now on, queued or not.
if not A.edf then join_fair_flow(A.band, A.tenant, A.weight) end

-- A batch held for companions (A.batch.hold) queues even so; it leaves with the next dispatch.
local held = A.batch ~= nil and A.batch.hold == true
if immediate and not held then
  local backend
  if pinned ~= nil then backend = backend_at(A.backends, pinned) else backend = pick_backend(A.backends) end
  if backend ~= nil then
    local lease = grant_lease(backend.url, A.replica, A.ttl, now, A.band, A.tenant, A.cost, A.kind)
    count_granted(A.band, A.tenant, A.cost)
    if A.seq ~= nil then follow_sequence(A.seq.k, A.seq.e, backend.url, now) end
    return cjson.encode({kind = 'granted', lease = lease, url = backend.url, view = view(nbands, A.backends, now)})
  end
end
local id = next_id()
local score
if A.edf then
  score = now + A.allowed_s
else
  score = 0  -- first come, first served within its flow: ids order by creation
end
local info = {r = A.replica, b = A.band, t = A.tenant, c = A.cost, e = fmt(now + A.allowed_s)}
if A.kind ~= nil and A.kind ~= '' then info.q = A.kind end
if A.batch then
  info.k = A.batch.key
  info.m = A.batch.max
end
if A.seq ~= nil then
  info.s = A.seq.k
  if A.seq.e then info.x = 1 end
  info.p = pinned
end
enqueue(id, info, score)
-- Less urgent requests it pushed past their allowance are told at once, and borrowers' where it is
-- an owner reclaiming its quota (policies.quotas.under_quota).
local reclaim = false
if A.quotas ~= nil and A.quotas[A.tenant] ~= nil then
  reclaim = (tenant_inflight()[A.tenant] or 0) + A.cost <= A.quotas[A.tenant].n
end
if A.drain ~= nil and A.drain > 0 and (reclaim or A.band < nbands - 1) then
  displace_overdue(A.band, nbands, now, reclaim)
end
-- The heads may be held back by quotas where this one is not, by a reservation that has since
-- shrunk (A.reserved_move: a window closed), or a batch may be held for companions (this one joins
-- it and lets it go, or is not for it and must not wait behind a free slot): their grants go onto
-- their lists.
if (A.quotas ~= nil and free > 0) or (A.reserved_move and free_slots(A.backends) > 0)
    or (free > 0 and not immediate and not held) then
  dispatch(nbands, A.backends, A.ttl, now, false, nil)
end
return cjson.encode({kind = 'queued', ticket = id, view = view(nbands, A.backends, now)})
