-- KEYS: box, taken  ARGV: lease_ms
-- Move the oldest item of a worker's box (pushed on the left: common.lua's push_box) to the end of
-- its taken list (bridge.py: dropped from there once applied), and give that list the box's lease
-- in the same step: a worker killed before it drops the item leaves no list behind for good.
-- Oldest first: two cancellations of one id (a call ended, its id reused by the next) land in
-- order, the later one's row last. Returns the item, or nil for an empty box.
mend(KEYS[1], 'list')
mend(KEYS[2], 'list')
local item = redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'RIGHT')
if item then redis.call('PEXPIRE', KEYS[2], ARGV[1]) end
return item
