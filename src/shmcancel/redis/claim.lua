-- KEYS: sweep. ARGV: now (float seconds), interval. Returns 1 for one caller per interval; the
-- first claim succeeds one interval after the key appears (as a new registry's claim does).
local last = redis.call('GET', KEYS[1])
if last and tonumber(ARGV[1]) - tonumber(last) < tonumber(ARGV[2]) then return 0 end
-- kept ten intervals past the last claim: a prefix no host uses any more leaves no key behind
redis.call('SET', KEYS[1], ARGV[1], 'PX', math.max(1000, math.floor(tonumber(ARGV[2]) * 10000)))
if not last then return 0 end
return 1
