-- KEYS: stopped. ARGV: box, keep_ms
-- A bridge stopped (its worker exits): its box is read no more, so it leaves the holders of the
-- sessions it served (common.lua, set_holder) and a DELETE skips it. Marks older than keep_ms
-- (Redis's clock) are forgotten: a session still listing that box has been renewed since (and
-- set_holder renews the mark of a box it keeps as its host's last).
local now = redis_ms()
mend(KEYS[1], 'zset')
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[2])))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
