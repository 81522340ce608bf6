-- KEYS: ifk... ARGV: deadline_ms, now_ms, owner... (ARGV[i + 2] belongs to KEYS[i])
-- Extends each owner's lease; returns the 1-based indexes of owners no longer present (Redis lost
-- them: restarted, or the lease ran out and someone dropped them) or whose lease ran out before
-- now_ms (the host stalled past it: what was pushed to its box meanwhile may have expired with
-- the box), for the caller to add again (track.lua, which hands the owner a cancellation recorded
-- for its request). A key another client wrote with another type is mended (deleted): its row is
-- missing, and added back (as is the scope's set of running ids, mended so, by track.lua).
local missing = {}
local now = tonumber(ARGV[2])
for i, k in ipairs(KEYS) do
  mend(k, 'zset')
  local old = redis.call('ZSCORE', k, ARGV[i + 2])
  local ifs = string.match(k, '^(.*):if:%x+$') .. ':ifs'
  if not old or tonumber(old) < now or mend(ifs, 'set') then
    missing[#missing + 1] = i
  else
    redis.call('ZADD', k, ARGV[1], ARGV[i + 2])
    for _, key in ipairs({k, ifs}) do
      if redis.call('PEXPIRETIME', key) < tonumber(ARGV[1]) then redis.call('PEXPIREAT', key, ARGV[1]) end
    end
  end
end
return missing
