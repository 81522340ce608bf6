-- KEYS: c, t, all, scopes, ifk, pc, pend
-- ARGV: P, scope, rid, reason_enc, at, quota (-1: none), cap, batch, gate ("1": only in flight),
--       now_ms, box_lease_ms, pending_ms (0: none), pending_max (per scope), pending_cap (all),
--       spare ("1": the eviction takes this scope's rows last, a session's DELETE)
-- Returns {0} not in flight, {-1} quota refused, {1, evicted} inserted, {2, 0} overwritten.
-- When gated, the cancellation is pushed to the box of every worker running the request; one
-- that finds none waits pending_ms in pc (at most pending_max per scope and pending_cap in all;
-- until when, in pend)
-- for a row of a request started by `at` that its host adds back later (Redis lost it: a
-- restart, a lease run out).
local c, t, all, scopes, ifk, pc, pend = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6],
                                         KEYS[7]
local P, scope, rid, reason, at = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
-- keys of another type (another client's writes) are mended first: an in-flight key so mended
-- holds nothing in flight until its owner's renewal adds its row back, which the cancellation
-- waits for (pending, below)
for k, kind in pairs({[c] = 'hash', [t] = 'zset', [ifk] = 'zset', [pc] = 'hash',
                      [pend] = 'zset'}) do
  mend(k, kind)
end
mend_index(P, all, scopes)
local owners = {}
if ARGV[9] == '1' then
  owners = live(ifk, ARGV[10])
  if #owners == 0 then
    local ms, now = tonumber(ARGV[12]), tonumber(ARGV[10])
    if ms > 0 then
      prune_pending(P, pend, now, 32)
      local m = member(scope, rid)
      if redis.call('ZSCORE', pend, m) or (redis.call('HLEN', pc) < tonumber(ARGV[13])
          and redis.call('ZCARD', pend) < tonumber(ARGV[14])) then
        -- the wait's end in the entry too: pend written over (mended) loses it
        redis.call('HSET', pc, rid, cmsgpack.pack({reason, at, now + ms}))
        redis.call('ZADD', pend, now + ms, m)
        outlive(pc, ms)
        outlive(pend, ms)
      end
    end
    return {0}
  end
end
local result = record(P, c, t, all, scopes, scope, rid, reason, at, tonumber(ARGV[6]),
                      tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[15] == '1')
if result[1] == -1 then return result end
local seen = {}
for _, owner in ipairs(owners) do
  local box = box_of(owner)
  if box and not seen[box] then
    seen[box] = true
    deliver(P, box, scope, rid, reason, at, ARGV[11])
  end
end
return result
