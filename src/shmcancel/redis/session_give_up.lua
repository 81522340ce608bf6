-- KEYS: sess, boxes, gone, stopped. ARGV: P, sid, payload, box_lease_ms, own box, gone_ms, now_ms
-- A host's own table gave the session up for its client's bound: ended everywhere as by a
-- DELETE (end_session, session_delete.lua), so that no other host serves it and none adopts it
-- again. Not while a call runs in it on some host (contract 6.1): returns -1, nothing written
-- (it lives on there; the giving host may adopt it again). Else how many boxes were told.
mend(KEYS[4], 'zset')
if session_busy(ARGV[1], ARGV[2], ARGV[7]) then return -1 end
return end_session(ARGV[1], KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[3], ARGV[4], ARGV[5],
                   ARGV[6])
