"""Kernel search: rules, cost model, tuning driver, cache (installed as ``relaxtune.schedules``)."""
