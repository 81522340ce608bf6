-- KEYS: sess, boxes, gone, stopped. ARGV: P, payload, box_lease_ms, own box, gone_ms
-- Ends a session everywhere (end_session): tells every other worker box that minted or adopted
-- it (they delete their host's copy), then forgets it, leaving `gone` for gone_ms. Returns how
-- many boxes were told.
mend(KEYS[4], 'zset')
return end_session(ARGV[1], KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], ARGV[3], ARGV[4],
                   ARGV[5])
