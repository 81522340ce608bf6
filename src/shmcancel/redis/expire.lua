-- KEYS: all, scopes. ARGV: P, last, limit. Removes up to `limit` rows with cancelled_at <= last
-- (the greatest at with now - at > ttl, store.last_expired); returns how many went. The caller
-- repeats while the limit was reached.
local rows = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, m in ipairs(rows) do
  local scope, rid = unmember(m)
  if scope == nil then
    redis.call('ZREM', KEYS[1], m)  -- not a row's member: dropped, not counted
  else
    n = n + remove(ARGV[1], KEYS[1], KEYS[2], scope, rid)
  end
end
return n
