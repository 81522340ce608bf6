-- KEYS: box, taken  ARGV: lease_ms
-- Move the newest item of a worker's box to its taken list (bridge.py: dropped from there once
-- applied), and give that list the box's lease in the same step: a worker killed before it drops
-- the item leaves no list behind for good. Returns the item, or nil for an empty box.
local item = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
if item then redis.call('PEXPIRE', KEYS[2], ARGV[1]) end
return item
