-- KEYS: up. ARGV: box, keep_ms, gone_ms (0: a live beat; else the bridge stops: its box beats as
-- if gone_ms ago, gone at once)
-- A bridge's beat at every renewal (common.lua, gone_box). Beats older than keep_ms are
-- forgotten: a holder gone that long has left the holders of every session still in use.
local now = redis_ms()
local at = now
if ARGV[3] ~= '0' then at = now - tonumber(ARGV[3]) - 1 end
redis.call('ZADD', KEYS[1], at, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[2])))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
