-- KEYS: sess, client_set, boxes, gone, stopped, alive ("" : none), restoring. ARGV: P, sid,
-- value, ttl_ms, per_client, now_ms, box, box_lease_ms, gone_ms, seen_ms, restoring_ms, then
-- pairs (other sid, its last use in ms on the storing host), at most per_client of them
-- Stores a session for other hosts to adopt, unless it was deleted lately (`gone`,
-- session_delete.lua: returns 0, the caller ends its copy); a client keeps at most per_client
-- sessions here: ids whose session is gone already leave its count first, then its oldest are
-- given up, ended everywhere as by a DELETE (end_session: every other holder's box told, `gone`
-- set), so that no host serves one that the others answer 404. Returns {1, the ids given up}:
-- the caller ends its own host's copies of them (its box is not told).
-- The set orders a client's sessions by their last use on any host (ms): seen_ms, now at a mint
-- or an adoption, the holder's own last-seen when it stores one again after Redis lost it (a
-- restore is no use), moved on by each renewal (keep.lua) and by the storing host's last use
-- of the client's other sessions it holds (the pairs: a renewal comes at most once a minute per
-- process, the host's table knows each use within its touch interval); never back.
-- A session with a call in flight on some host is never given up (contract 6.1): another host
-- would answer its requests 404, its notifications/cancelled too; the client may hold more
-- until those calls end. Nor is any while `restoring` lives, and the set is not walked then
-- (nor the gone ids dropped): Redis lost data (a FLUSHALL, a restart) and the workers store
-- their in-flight rows and sessions again each on its own schedule, so a busy session may be
-- back before its call's row. A bridge sets it as it sees the loss (its alive key gone, or
-- Redis back after an outage: bridge.py), and so does a store whose worker's `alive` key (given
-- once set) is gone: it stores before its bridge has seen the loss. For restoring_ms (a lease
-- and a renewal period: every worker restores within it); the client may hold more meanwhile.
local function busy(sid)
  local scope = 'session:' .. sid
  if mend(skey(ARGV[1], scope, 'ifs'), 'set') then return false end
  for _, rid in ipairs(redis.call('SMEMBERS', skey(ARGV[1], scope, 'ifs'))) do
    if running(ARGV[1], scope, rid, ARGV[6]) then return true end
  end
  return false
end
mend(KEYS[4], 'string')
if redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
if KEYS[6] ~= '' and redis.call('EXISTS', KEYS[6]) == 0 then
  redis.call('SET', KEYS[7], '1', 'PX', ARGV[11])
end
mend(KEYS[2], 'zset')
mend(KEYS[5], 'zset')
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
set_holder(ARGV[1], KEYS[3], ARGV[7], KEYS[5], tonumber(ARGV[4]) + 60000)
redis.call('PEXPIRE', KEYS[3], ARGV[4])
redis.call('ZADD', KEYS[2], 'GT', ARGV[10], ARGV[2])
for i = 12, math.min(#ARGV, 11 + 2 * tonumber(ARGV[5])) - 1, 2 do
  if ARGV[i] ~= ARGV[2] then redis.call('ZADD', KEYS[2], 'XX', 'GT', ARGV[i + 1], ARGV[i]) end
end
redis.call('PEXPIRE', KEYS[2], ARGV[4])
local given_up = {1}
local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
-- restoring: nothing given up, nor the set walked (a client minting meanwhile would make each
-- of its stores cost as many lookups as it holds sessions)
if extra > 0 and redis.call('EXISTS', KEYS[7]) == 0 then
  -- sessions gone already (deleted, expired, given up) count no more: they go first, so
  -- that a client at its bound gives up none of its live sessions for them
  local olds = redis.call('ZRANGE', KEYS[2], 0, -1)
  for _, old in ipairs(olds) do
    if extra <= 0 then break end
    if old ~= ARGV[2] and redis.call('EXISTS', ARGV[1] .. 'sess:' .. old) == 0 then
      redis.call('ZREM', KEYS[2], old)
      extra = extra - 1
    end
  end
  for _, old in ipairs(olds) do
    if extra <= 0 then break end
    if old ~= ARGV[2] and not busy(old) and redis.call('ZSCORE', KEYS[2], old) then
      local k = ARGV[1] .. 'sess:' .. old
      end_session(ARGV[1], k, k .. ':boxes', k .. ':gone', KEYS[5],
                  cmsgpack.pack({'d', old}), ARGV[8], ARGV[7], ARGV[9])
      redis.call('ZREM', KEYS[2], old)
      given_up[#given_up + 1] = old
      extra = extra - 1
    end
  end
end
return given_up
