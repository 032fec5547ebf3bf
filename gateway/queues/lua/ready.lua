-- Record backend readiness seen by a replica, then dispatch into slots that became usable.
-- ARGV: nbands, lease_ttl_s, drain_tau, nbackends, (url, max_concurrency, queued)..., then (url, '0'|'1')...
-- Returns the number of grants.
local nbands, ttl, drain_tau = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local backends, next_arg = read_backends(5)
for i = next_arg, #ARGV, 2 do
  redis.call('HSET', tag .. ':ready', ARGV[i], ARGV[i + 1])
end
return dispatch(nbands, backends, ttl, now_s(), false, drain_tau)
