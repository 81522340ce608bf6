-- KEYS: ifk, c, t, all, scopes, ifs. ARGV: P, scope, rid, owner, now_ms, before ("" = any)
-- Ends a running request; when no namesake runs on, its cancellation row goes too (the end of a
-- request is untrack, then clear), only when cancelled_at < before if given (an end landing
-- late: a row recorded since is a later cancellation's). Returns 1 when the owner was in flight.
for i, kind in ipairs({'zset', 'hash', 'zset', false, false, 'set'}) do
  if kind then mend(KEYS[i], kind) end
end
mend_index(ARGV[1], KEYS[4], KEYS[5])
local removed = redis.call('ZREM', KEYS[1], ARGV[4])
if #live(KEYS[1], ARGV[5]) == 0 then
  local at = ARGV[6] ~= '' and redis.call('ZSCORE', KEYS[3], ARGV[3])
  if not at or tonumber(at) < tonumber(ARGV[6]) then
    remove(ARGV[1], KEYS[4], KEYS[5], ARGV[2], ARGV[3])
  end
  redis.call('SREM', KEYS[6], ARGV[3])
end
return removed
