-- KEYS: all, scopes. ARGV: P, last, limit. Looks at up to `limit` members with cancelled_at <= last
-- (the greatest at with now - at > ttl, store.last_expired) and removes their rows; returns
-- {rows removed, members looked at}. The caller repeats while `limit` members were looked at. A
-- member that names no row of ours goes from the index, not counted: one not of the member form,
-- one whose row is not there (left, it would be looked at again by every sweep, and `limit` of
-- them would hide every row behind them), as when its scope's rows keys held another type
-- (another client's write: mended, see remove).
mend_index(ARGV[1], KEYS[1], KEYS[2])
local rows = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, m in ipairs(rows) do
  local scope, rid = unmember(m)
  if scope == nil then
    redis.call('ZREM', KEYS[1], m)  -- not a row's member: dropped, not counted
  elseif remove(ARGV[1], KEYS[1], KEYS[2], scope, rid) == 1 then
    n = n + 1
  else
    redis.call('ZREM', KEYS[1], m)  -- no such row
  end
end
return {n, #rows}
