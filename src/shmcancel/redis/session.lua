-- KEYS: sess, client_set, boxes, gone. ARGV: P, sid, value, ttl_ms, per_client, now_ms, box
-- Stores a session for other hosts to adopt (returns 1), unless it was deleted lately (`gone`,
-- session_delete.lua: returns 0, the caller ends its copy); a client keeps at most per_client
-- sessions here
-- (its oldest go first; hosts that adopted one keep their local copy under contract 6.1's rules).
-- A session with a call in flight on some host is never given up (contract 6.1): another host
-- would answer its requests 404, its notifications/cancelled too; the client may hold more
-- until those calls end.
local function busy(sid)
  local scope = 'session:' .. sid
  for _, rid in ipairs(redis.call('SMEMBERS', skey(ARGV[1], scope, 'ifs'))) do
    if running(ARGV[1], scope, rid, ARGV[6]) then return true end
  end
  return false
end
if redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
redis.call('SADD', KEYS[3], ARGV[7])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if extra > 0 then
  for _, old in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    if extra <= 0 then break end
    if old ~= ARGV[2] and not busy(old) then
      redis.call('DEL', ARGV[1] .. 'sess:' .. old, ARGV[1] .. 'sess:' .. old .. ':boxes')
      redis.call('ZREM', KEYS[2], old)
      extra = extra - 1
    end
  end
end
return 1
