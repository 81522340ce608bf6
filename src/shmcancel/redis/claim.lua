-- KEYS: sweep. ARGV: now (float seconds), interval. Returns 1 for one caller per interval; the
-- first claim succeeds one interval after the key appears (as a new registry's claim does).
-- A last claim more than an interval ahead of now is due too: the claimer's clock stepped back
-- (NTP, a restored VM), and waiting for it to catch up would stop the sweeps for as long as the
-- step (as Registry.claim_sweep, shm/registry.py's sweep_due).
mend(KEYS[1], 'string')
-- a value that is no number (another client's write) counts as no claim: it is written over
local last = tonumber(redis.call('GET', KEYS[1]))
local now, interval = tonumber(ARGV[1]), tonumber(ARGV[2])
if last and now - last < interval and last - now <= interval then return 0 end
-- kept ten intervals past the last claim: a prefix no host uses any more leaves no key behind
redis.call('SET', KEYS[1], ARGV[1], 'PX', math.max(1000, math.floor(tonumber(ARGV[2]) * 10000)))
if not last then return 0 end
return 1
