"""The Lua every script of the store starts with: the shebang that holds it to one
cluster slot, and Redis's own clock, in milliseconds.

One clock for the whole fleet: deadlines, leases, accrual marks and budget
reservations are all judged on the Redis server's TIME, so the gateways',
workers' and scaler's clocks need not agree.
"""

from __future__ import annotations

# The first line of every script the store registers. A script that declares
# itself this way is held by Redis Cluster to one slot: touching a key of
# another slot (another tier's, say) fails the script with "Script attempted to
# access keys that do not hash to the same slot", where a script without it
# would silently work whenever both slots happen to live on one node. Needs
# Redis >= 7.0. tests/processes/test_cluster_line.py checks every registered script starts so.
SHEBANG = "#!lua\n"

CLOCK = SHEBANG + """local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Redis turns Lua numbers into strings with 14 significant digits; scores and
-- amounts need all 16, so every number bound for Redis goes through n2s.
local function n2s(x) return string.format('%.0f', x) end
"""
