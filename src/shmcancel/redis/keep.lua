-- KEYS: sess, boxes, gone, client_set ("" : none), stopped. ARGV: ttl_ms, box, now_ms, sid, P
-- A worker serving a session renews its copy's lifetime (and its client's set's, when given)
-- and lists its box among the holders a DELETE tells (session_delete.lua): a host's copy lives
-- in its registry for every worker there, so the one that adopted it may have died since.
-- A renewal is a use: the session's place in its client's set (session.lua's order, its last
-- use on any host) moves on to now_ms, never back (another host's renewal may be later).
-- Returns -1 when the session was deleted lately (`gone`: the caller ends its copy), 0 when
-- Redis holds no copy (a copy no host can adopt, another client's write, is deleted: the
-- caller stores its own again), 1 when renewed.
mend(KEYS[3], 'string')
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
if not session_ok(KEYS[1]) then redis.call('DEL', KEYS[1]) end
if KEYS[4] ~= '' then mend(KEYS[4], 'zset') end
mend(KEYS[5], 'zset')
if redis.call('PEXPIRE', KEYS[1], ARGV[1]) == 0 then return 0 end
set_holder(ARGV[5], KEYS[2], ARGV[2], KEYS[5], tonumber(ARGV[1]) + 60000)
redis.call('PEXPIRE', KEYS[2], ARGV[1])
if KEYS[4] ~= '' then
  redis.call('ZADD', KEYS[4], 'XX', 'GT', ARGV[3], ARGV[4])
  redis.call('PEXPIRE', KEYS[4], ARGV[1])
end
return 1
