-- Hand free slots to waiting tickets: a batch held for companions (offer.lua: A.batch.hold) has
-- waited as long as it may.
-- A: replica (the caller), bands, backends, ttl, now (tests).
-- Returns {granted, view, mine: the grants for the caller}.
local now = now_s()
local granted, mine = 0, {}
if live(A.replica, now) then granted, mine = dispatch(A.bands, A.backends, A.ttl, now, false, A.replica) end
return cjson.encode({granted = granted, view = view(A.bands, A.backends, now), mine = mine})
