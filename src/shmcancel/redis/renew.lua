-- KEYS: ifk... ARGV: deadline_ms, owner... (ARGV[i + 1] belongs to KEYS[i])
-- Extends each owner's lease; returns the 1-based indexes of owners no longer present (Redis lost
-- them: restarted, or the lease ran out), for the caller to add again.
local missing = {}
for i, k in ipairs(KEYS) do
  if redis.call('ZADD', k, 'XX', 'CH', ARGV[1], ARGV[i + 1]) == 0 and not redis.call('ZSCORE', k, ARGV[i + 1]) then
    missing[#missing + 1] = i
  else
    local ifs = string.match(k, '^(.*):if:%x+$') .. ':ifs'
    for _, key in ipairs({k, ifs}) do
      if redis.call('PEXPIRETIME', key) < tonumber(ARGV[1]) then redis.call('PEXPIREAT', key, ARGV[1]) end
    end
  end
end
return missing
