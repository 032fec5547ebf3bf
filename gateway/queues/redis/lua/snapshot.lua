-- The view for admission and metrics; also counts arrivals refused locally since the last script.
-- A: bands, refused, backends, now (tests).
local now = now_s()
count_refused_locally(A.bands)
return cjson.encode(view(A.bands, A.backends, now))
