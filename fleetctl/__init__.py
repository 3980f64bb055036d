"""The `fleet` command: one console script that starts each part of the fleet, or all of them.

It sits above every part (gateway, workers, scaler, simulator) and the core
(`fleet`); nothing imports it.
"""
