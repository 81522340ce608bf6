-- KEYS: ifk, c, t, all, scopes, ifs (the scope's running ids), pc (its pending cancellations),
--       pend (until when each waits)
-- ARGV: P, scope, rid, owner, deadline_ms, now_ms, started_at, quota (-1: none), cap, batch
-- Adds a running request (a new one, or one Redis lost, added back). A cancellation row older
-- than the request, with no other request of that key running, is not this request's: it goes
-- (contract 4.3); one recorded at or after its start is, and is delivered to this owner's box.
-- A pending cancellation (cancel.lua found nothing in flight) sent at or after
-- the request's start, and still waiting, was meant for it: it is recorded, delivered to this
-- owner's box and stops waiting.
-- Returns 1, or 2 when a pending cancellation was delivered.
local ifk = KEYS[1]
local P, scope, rid, owner, started = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[7])
local box, box_lease_ms = box_of(owner), tonumber(ARGV[5]) - tonumber(ARGV[6])
for i, kind in ipairs({'zset', 'hash', 'zset', false, false, 'set', 'hash', 'zset'}) do
  if kind then mend(KEYS[i], kind) end
end
mend_index(P, KEYS[4], KEYS[5])
if #live(ifk, ARGV[6]) == 0 then
  local at = redis.call('ZSCORE', KEYS[3], rid)
  if at and tonumber(at) < started then
    remove(P, KEYS[4], KEYS[5], scope, rid)
  elseif at then
    -- recorded for this request while it ran (its row added back now: the box that held the
    -- cancellation may have expired while the host stalled past its lease): delivered again
    local reason = redis.call('HGET', KEYS[2], rid)
    if reason then deliver(P, box, scope, rid, reason, at, box_lease_ms) end
  end
end
-- The scope's running ids lose ids whose every owner's lease ran out (a worker killed, a host
-- died: their untrack never came) a few at a time, so that set stays bounded in a scope that
-- never falls idle (each track extends its life). SRANDMEMBER with a count returns the whole set
-- when it is that small.
for _, old in ipairs(redis.call('SRANDMEMBER', KEYS[6], 3)) do
  if old ~= rid and not running(P, scope, old, ARGV[6]) then
    redis.call('SREM', KEYS[6], old)
  end
end
redis.call('ZADD', ifk, ARGV[5], owner)
redis.call('SADD', KEYS[6], rid)
for _, k in ipairs({ifk, KEYS[6]}) do
  if redis.call('PEXPIRETIME', k) < tonumber(ARGV[5]) then redis.call('PEXPIREAT', k, ARGV[5]) end
end
local raw = redis.call('HGET', KEYS[7], rid)
local m = member(scope, rid)
local ok, p
if raw then ok, p = pcall(cmsgpack.unpack, raw) end
ok = ok and type(p) == 'table'
-- until when it waits: its score in pend, else (pend written over, so mended) the end kept in
-- the entry; an entry with neither still waits (its scope's pc has a TTL: the wait is bounded)
local waits = raw and tonumber(redis.call('ZSCORE', KEYS[8], m) or (ok and p[3]))
if raw and waits and not (waits >= tonumber(ARGV[6])) then
  unpend(KEYS[7], KEYS[8], rid, m)  -- its wait is over
elseif raw then
  local at = ok and type(p[1]) == 'string' and tonumber(p[2])
  -- the entry may be another client's: only a finite time, written as ZADD reads it (tonumber
  -- takes ' 5', '1e400' that ZADD refuses, failing the script after the row was added)
  if at and at == at and at > -math.huge and at < math.huge and at >= started then
    local ats = string.format('%.17g', at)
    local r = record(P, KEYS[2], KEYS[3], KEYS[4], KEYS[5], scope, rid, p[1], ats,
                     tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]))
    if r[1] ~= -1 then
      deliver(P, box, scope, rid, p[1], ats, box_lease_ms)
      -- landed once: a later add back must not land it again over a newer cancellation's row
      unpend(KEYS[7], KEYS[8], rid, m)
      return 2
    end
  end
end
return 1
