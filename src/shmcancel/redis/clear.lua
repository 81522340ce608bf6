-- KEYS: c, t, all, scopes. ARGV: P, scope, rid, before ("" = unconditional)
-- Removes the row (only when cancelled_at < before, if given). Returns 1 when removed.
mend(KEYS[1], 'hash')
mend(KEYS[2], 'zset')
mend_index(ARGV[1], KEYS[3], KEYS[4])
local at = redis.call('ZSCORE', KEYS[2], ARGV[3])
if not at then return 0 end
if ARGV[4] ~= '' and tonumber(at) >= tonumber(ARGV[4]) then return 0 end
return remove(ARGV[1], KEYS[3], KEYS[4], ARGV[2], ARGV[3])
