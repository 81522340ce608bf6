-- Shared helpers, prepended to every script. Key layout (P = the prefix):
--   P{<sha1(scope)>}:c          hash   rid -> reason ("" = None, "=" .. text)
--   P{<sha1(scope)>}:t          zset   rid -> cancelled_at (float seconds)
--   P{<sha1(scope)>}:if:<sha1(rid)>  zset   owner -> lease deadline (ms); one member per running request
--   P{<sha1(scope)>}:ifs        set    ids in flight in the scope (pruned as their owners go)
--   P{<sha1(scope)>}:pc         hash   rid -> {reason, at, until (ms)}: gated cancellations that
--                                      found nothing in flight, for a row added back later
--                                      (track.lua)
--   P{g}:all                    zset   <#scope>:<scope><rid> -> cancelled_at (global count, TTL, cap)
--   P{g}:pend                   zset   <#scope>:<scope><rid> -> until when (ms) its pc entry waits
--   P{g}:scopes                 zset   scope -> its row count (eviction order)
--   Pbox:<host>:<pid>:<tag>     list   cancellations for one worker to apply to its host's segment
--   Psess:<sid>                 string a session for other hosts to adopt (msgpack [version, client])
--   Psess:<sid>:boxes           set    the boxes of the workers holding it (told of its end)
--   P{g}:stopped                zset   box -> Redis time (ms) its bridge stopped (stopped.lua)
--   Psess:<sid>:gone            string it ended lately (a DELETE, its client's bound): never
--                                      stored again meanwhile
--   P{cl:<sha1(client)>}:s      zset   a client's sessions (per_client bound)
--   Palive:<box>                string its worker's bridge runs (a lease's TTL)
--   P{g}:live                   zset   box -> when (ms, its host's clock) it last set its alive
--                                      key: the boxes to tell when a session's holders are unknown
--                                      (session_mend.lua), or a host's have stopped (end_session)
--   Psess:<sid>:mending         string its damaged copy was deleted and workers told to store it
--                                      again (session_mend.lua): a lookup meanwhile is 503
-- How long a box stays in P{g}:live after it last renewed its alive key.
local LIVE_KEPT_MS = 600000  -- store.py's LIVE_KEPT_MS: set_alive prunes by it too
local function member(scope, rid) return #scope .. ':' .. scope .. rid end
local function unmember(m)  -- nil for a member not of that form (written by another client)
  local colon = string.find(m, ':', 1, true)
  if not colon then return nil end
  local n = tonumber(string.sub(m, 1, colon - 1))
  if not n or n < 0 or n % 1 ~= 0 or colon + n > #m then return nil end
  return string.sub(m, colon + 1, colon + n), string.sub(m, colon + n + 1)
end
local function skey(P, scope, kind) return P .. '{' .. redis.sha1hex(scope) .. '}:' .. kind end
-- A key of ours that holds another type (another client wrote over it) is damage: it is deleted,
-- so that the script goes on (a WRONGTYPE would fail it, and every later one touching the key)
-- and what belongs there is written again (the next renew adds a lost in-flight row back, the
-- next publish a session). True when it was deleted.
local function mend(k, kind)
  local got = redis.call('TYPE', k).ok
  if got == kind or got == 'none' then return false end
  redis.call('DEL', k)
  return true
end
local function remove(P, all, scopes, scope, rid)
  local c, t = skey(P, scope, 'c'), skey(P, scope, 't')
  mend(c, 'hash')
  mend(t, 'zset')
  if redis.call('HDEL', c, rid) == 0 then return 0 end
  redis.call('ZREM', t, rid)
  redis.call('ZREM', all, member(scope, rid))
  if tonumber(redis.call('ZINCRBY', scopes, -1, scope)) <= 0 then redis.call('ZREM', scopes, scope) end
  return 1
end
-- The global index (all) and the scopes' row counts (scopes), either rebuilt from the other when
-- it was damaged (mend): every row keeps its place in the cap's eviction order and its expiry.
local function mend_index(P, all, scopes)
  local lost_all, lost_scopes = mend(all, 'zset'), mend(scopes, 'zset')
  if lost_all and not lost_scopes then
    for _, scope in ipairs(redis.call('ZRANGE', scopes, 0, -1)) do
      local t = skey(P, scope, 't')
      if not mend(t, 'zset') then
        local rows = redis.call('ZRANGE', t, 0, -1, 'WITHSCORES')
        for j = 1, #rows, 2 do redis.call('ZADD', all, rows[j + 1], member(scope, rows[j])) end
      end
    end
  elseif lost_scopes and not lost_all then
    for _, m in ipairs(redis.call('ZRANGE', all, 0, -1)) do
      local scope = unmember(m)
      if scope ~= nil then redis.call('ZINCRBY', scopes, 1, scope) end
    end
  end
end
-- Whether x sorts before y byte by byte (as code points: UTF-8), the contract's order. Lua's "<"
-- is strcoll in the server's locale (redis-server sets LC_COLLATE from its environment).
local function bytes_before(x, y)
  local n = math.min(#x, #y)
  for i = 1, n do
    local a, b = string.byte(x, i), string.byte(y, i)
    if a ~= b then return a < b end
  end
  return #x < #y
end
-- contract 4.4: rank rows by (-rows_in_scope, cancelled_at, scope, rid), remove the first `batch`.
-- Scopes are visited largest first; scopes of one size are merged by age; from each scope at most
-- the rows still wanted are read (ZRANGE orders by score, then rid bytewise). The rows of scope
-- `spare` (a session's DELETE: its pass must not evict the rows it wrote) are taken last.
local function evict(P, all, scopes, batch, spare)
  local groups = redis.call('ZREVRANGE', scopes, 0, -1, 'WITHSCORES')
  if spare then
    local kept = {}
    for i = 1, #groups, 2 do
      if groups[i] ~= spare then kept[#kept + 1] = groups[i]; kept[#kept + 1] = groups[i + 1] end
    end
    if #kept < #groups then
      kept[#kept + 1] = spare
      kept[#kept + 1] = '-1'  -- a size no scope has: its own group, visited last
    end
    groups = kept
  end
  local victims = {}
  local i = 1
  while i <= #groups and #victims < batch do
    local size = tonumber(groups[i + 1])
    local cand = {}
    while i <= #groups and tonumber(groups[i + 1]) == size do
      local scope = groups[i]
      mend(skey(P, scope, 't'), 'zset')
      local rows = redis.call('ZRANGE', skey(P, scope, 't'), 0, batch - #victims - 1, 'WITHSCORES')
      for j = 1, #rows, 2 do cand[#cand + 1] = {tonumber(rows[j + 1]), scope, rows[j]} end
      i = i + 2
    end
    table.sort(cand, function(a, b)
      if a[1] ~= b[1] then return a[1] < b[1] end
      if a[2] ~= b[2] then return bytes_before(a[2], b[2]) end
      return bytes_before(a[3], b[3])
    end)
    for j = 1, #cand do
      if #victims >= batch then break end
      victims[#victims + 1] = cand[j]
    end
  end
  for _, v in ipairs(victims) do remove(P, all, scopes, v[2], v[3]) end
  return #victims
end
-- Record a cancellation (contract 4.3: quota, then cap eviction, then insert; an existing row
-- is overwritten in place). Returns {-1} quota refused, {1, evicted} inserted, {2, 0} overwritten.
local function record(P, c, t, all, scopes, scope, rid, reason, at, quota, cap, batch, spare)
  if redis.call('HEXISTS', c, rid) == 1 then
    redis.call('HSET', c, rid, reason)
    redis.call('ZADD', t, at, rid)
    redis.call('ZADD', all, at, member(scope, rid))
    return {2, 0}
  end
  if quota >= 0 and redis.call('HLEN', c) >= quota then return {-1} end
  local evicted = 0
  if redis.call('ZCARD', all) >= cap then
    evicted = evict(P, all, scopes, batch, spare and scope or nil)
  end
  redis.call('HSET', c, rid, reason)
  redis.call('ZADD', t, at, rid)
  redis.call('ZADD', all, at, member(scope, rid))
  redis.call('ZINCRBY', scopes, 1, scope)
  return {1, evicted}
end
-- The box of the worker owning an in-flight member: the member before its newline; nil for a
-- member without one (written by another client: it names no box).
local function box_of(owner)
  local nl = string.find(owner, '\n', 1, true)
  return nl and string.sub(owner, 1, nl - 1)
end
-- Tell a worker (its box) of a cancellation recorded at `at` (its cancelled_at, as text): the
-- worker stamps its local row with it, so a call of the id that began after it ignores it.
-- Push `item` into a worker's box, which keeps its newest BOX_MAX items: a box its worker does
-- not read (its registry lock stalled) would otherwise grow with every cancellation a client
-- repeats for the same call, each push renewing its lease.
local BOX_MAX = 4096
local function push_box(P, box, item, box_lease_ms)
  local k = P .. 'box:' .. box
  mend(k, 'list')
  redis.call('LPUSH', k, item)
  redis.call('LTRIM', k, 0, BOX_MAX - 1)
  redis.call('PEXPIRE', k, box_lease_ms)
end
local function deliver(P, box, scope, rid, reason, at, box_lease_ms)
  push_box(P, box, cmsgpack.pack({scope, rid, reason, at}), box_lease_ms)
end
-- A pending cancellation stops waiting: its entry in the scope's pc, and member m in pend.
local function unpend(pc, pend, rid, m)
  redis.call('HDEL', pc, rid)
  redis.call('ZREM', pend, m)
end
-- Give key k at least ms more milliseconds to live.
local function outlive(k, ms)
  if redis.call('PTTL', k) < ms then redis.call('PEXPIRE', k, ms) end
end
-- Drop up to n pending cancellations whose wait ended before now_ms (the oldest first): from
-- pend, and from their scope's pc.
local function prune_pending(P, pend, now_ms, n)
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', pend, '-inf', '(' .. now_ms, 'LIMIT', 0, n)) do
    local scope, rid = unmember(m)
    if scope ~= nil and not mend(skey(P, scope, 'pc'), 'hash') then
      redis.call('HDEL', skey(P, scope, 'pc'), rid)
    end
    redis.call('ZREM', pend, m)
  end
end
-- Whether some owner's lease on (scope, rid) still runs at now_ms (read only: nothing dropped).
local function running(P, scope, rid, now_ms)
  local ifk = skey(P, scope, 'if:' .. redis.sha1hex(rid))
  return not mend(ifk, 'zset') and redis.call('ZCOUNT', ifk, now_ms, '+inf') > 0
end
-- Drop owners whose lease ran out; the owners left.
local function live(ifk, now_ms)
  redis.call('ZREMRANGEBYSCORE', ifk, '-inf', '(' .. now_ms)
  return redis.call('ZRANGE', ifk, 0, -1)
end
-- Whether a box's bridge stopped (its worker exited): nobody reads that box again. A worker killed
-- without stopping stays listed until the session ends. An error reading the mark (a key of
-- another type at P{g}:stopped, which the scripts mend first) counts as not stopped: the box is
-- kept, and told.
local function stopped_box(stopped, box)
  return type(redis.pcall('ZSCORE', stopped, box)) == 'string'
end
-- Whether a box's bridge runs: its alive key set (renewed every turn, for a lease).
local function alive_box(P, box)
  return redis.call('EXISTS', P .. 'alive:' .. box) == 1
end
-- Redis's clock, in ms (the stop marks' time, stopped.lua and set_holder).
local function redis_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Whether session key k holds what a host can adopt: a string, msgpack [version, client].
local function session_ok(k)
  if redis.call('TYPE', k).ok ~= 'string' then return false end
  local ok, v = pcall(cmsgpack.unpack, redis.call('GET', k))
  return ok and type(v) == 'table' and #v == 2 and type(v[1]) == 'string'
         and type(v[2]) == 'string'
end
-- The host a box names (Pbox:<host>:<pid>:<tag>, storage.py's box; a bridge's <host> names its
-- registry too, bridge.py's registry_host: the copy a host's workers share): nil for a box not
-- of that form (written by another client).
local function host_of(box)
  return string.match(box, '^(.*):[^:]*:[^:]*$')
end
-- Live boxes of the live index (P{g}:live) looked at, at most, newest first, by end_session for
-- the hosts whose holders all stopped.
local LIVE_LOOKED = 256
-- For each host of `wanted` (host -> true), one live box of that host: its alive key set and
-- not marked stopped. The hosts none was found for are left out (their workers set no alive key
-- lately, or are older than LIVE_LOOKED others).
local function live_of_hosts(P, stopped, wanted)
  local found, left = {}, 0
  for _ in pairs(wanted) do left = left + 1 end
  local live = P .. '{g}:live'
  if left == 0 or mend(live, 'zset') then return found end
  for _, box in ipairs(redis.call('ZREVRANGE', live, 0, LIVE_LOOKED - 1)) do
    local host = host_of(box)
    if host and wanted[host] and not found[host]
        and alive_box(P, box) and not stopped_box(stopped, box) then
      found[host] = box
      left = left - 1
      if left == 0 then break end
    end
  end
  return found
end
-- End a session everywhere (a DELETE, or its client's bound giving it up): every holder's box
-- but own_box (its caller ends its own copy) is told with `payload` (msgpack ['d', sid]: it
-- deletes its host's copy and cancels the calls begun on it), then its copy (sess), holders
-- (boxes) and mending mark go, leaving `gone` for gone_ms: a holder that stores it again
-- meanwhile (its renewal racing this, an adoption between its lookup and its store, its
-- recovery after Redis lost the session and so the boxes to tell) is refused and ends its copy.
-- A stopped holder's box is not told (nobody reads it, see stopped_box); the copy lives in its
-- host's registry for every worker there, so when no holder of that host (nor own_box's host)
-- was told, one live box of that host is (live_of_hosts), which ends the host's copy as a
-- holder would. A holder whose alive key is gone (a worker killed outright never marks its box
-- stopped; its bridge renewed that key every few seconds) is told all the same, but does not
-- count as its host told. When that host has no live box either, no worker of it is told (one
-- serving the copy while `gone` lasts is refused its renewal and ends it). Returns how many
-- were told.
local function end_session(P, sess, boxes, gone, stopped, payload, box_lease_ms, own_box, gone_ms)
  mend(boxes, 'set')
  local n = 0
  local reached, wanted = {}, {}
  local own_host = host_of(own_box)
  if own_host then reached[own_host] = true end
  for _, box in ipairs(redis.call('SMEMBERS', boxes)) do
    local host = host_of(box)
    if box ~= own_box then
      if not stopped_box(stopped, box) then
        push_box(P, box, payload, box_lease_ms)
        n = n + 1
        if host and alive_box(P, box) then
          reached[host] = true
        elseif host then
          wanted[host] = true
        end
      elseif host then
        wanted[host] = true
      end
    end
  end
  for host in pairs(reached) do wanted[host] = nil end
  for _, box in pairs(live_of_hosts(P, stopped, wanted)) do
    push_box(P, box, payload, box_lease_ms)
    n = n + 1
  end
  redis.call('DEL', sess, boxes, sess .. ':mending')
  redis.call('SET', gone, '1', 'PX', gone_ms)
  return n
end
-- List `box` among a session's holders; the stopped among (up to) HOLDERS_LOOKED of them leave:
-- each worker that ever served a long-lived session stayed listed, recycled ones too, and a
-- DELETE told them all. A stopped box stays while it is the one box of its host listed and
-- that host lives (`alive-host:<host>`, set with its workers' alive keys, kept LIVE_KEPT_MS):
-- the host's registry keeps the copy for its other workers, and end_session finds the host
-- (and tells a live box of it) only through a box of it listed here. Its stop mark is kept as
-- long (keep_ms past now at least): forgotten, the box would count as live and stay for good.
-- A host gone for good (a restarted server has a new registry, so a new host part) leaves. A
-- box never marked (a worker killed outright) stays until the session ends: an alive key
-- that lapsed says too little (Redis full, a starved thread) to drop a holder for.
local HOLDERS_LOOKED = 32
local function set_holder(P, boxes, box, stopped, keep_ms)
  mend(boxes, 'set')
  redis.call('SADD', boxes, box)
  local stays, gone = {}, {}
  if host_of(box) then stays[host_of(box)] = true end
  for _, b in ipairs(redis.call('SRANDMEMBER', boxes, HOLDERS_LOOKED)) do
    local h = host_of(b)
    if b ~= box and stopped_box(stopped, b) then
      gone[#gone + 1] = b
    elseif h then
      stays[h] = true
    end
  end
  local now
  for _, b in ipairs(gone) do
    local h = host_of(b)
    if h and not stays[h] and redis.call('EXISTS', P .. 'alive-host:' .. h) == 1 then
      stays[h] = true  -- the host's one box left listed
      now = now or redis_ms()
      redis.pcall('ZADD', stopped, now, b)
      outlive(stopped, keep_ms)
    else
      redis.call('SREM', boxes, b)
    end
  end
end
