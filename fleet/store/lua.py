"""The Lua every script of the store starts with: Redis's own clock, in milliseconds.

One clock for the whole fleet: deadlines, leases, accrual marks and budget
reservations are all judged on the Redis server's TIME, so the gateways',
workers' and scaler's clocks need not agree.
"""

from __future__ import annotations

CLOCK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Redis turns Lua numbers into strings with 14 significant digits; scores and
-- amounts need all 16, so every number bound for Redis goes through n2s.
local function n2s(x) return string.format('%.0f', x) end
"""
