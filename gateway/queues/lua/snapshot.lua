-- View for admission and metrics; also counts arrivals refused locally since the last script.
-- ARGV: nbands, tau_slow, tau_fast, nbands counts refused locally, nbackends, backends...
local nbands, tau_slow, tau_fast = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local backends = read_backends(5 + nbands)
local now = now_s()
count_refused_locally(4, nbands, now, tau_slow)
return snapshot(nbands, backends, now, tau_slow, tau_fast)
