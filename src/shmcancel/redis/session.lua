-- KEYS: sess, client_set, boxes. ARGV: P, sid, value, ttl_ms, per_client, now_ms, box
-- Stores a session for other hosts to adopt; a client keeps at most per_client sessions here
-- (its oldest go first; hosts that adopted one keep their local copy under contract 6.1's rules).
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
redis.call('SADD', KEYS[3], ARGV[7])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if extra > 0 then
  for _, old in ipairs(redis.call('ZRANGE', KEYS[2], 0, extra - 1)) do
    redis.call('DEL', ARGV[1] .. 'sess:' .. old, ARGV[1] .. 'sess:' .. old .. ':boxes')
  end
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, extra - 1)
end
return 1
