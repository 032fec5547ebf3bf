-- Free a lease's slot (idempotent) and hand it to the next waiter.
-- ARGV: lease, nbands, lease_ttl_s, drain_tau, tau_slow, tau_fast, caller replica,
--       nbackends, (url, max_concurrency, queued)...
-- Returns {freed (0|1), granted, snapshot, grants for the caller}.
local lease, nbands, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local drain_tau, tau_slow, tau_fast = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local backends = read_backends(9)
local now = now_s()
local granted, mine = 0, {}
local freed = free_lease(lease)
if freed then granted, mine = dispatch(nbands, backends, ttl, now, true, drain_tau, ARGV[7]) end
return {freed and 1 or 0, granted, snapshot(nbands, backends, now, tau_slow, tau_fast), mine}
