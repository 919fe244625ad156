"""`python -m bench.store`: The records path: what a record costs the serving process, the stores' write and read rates, volume and upgrades, faults.

Subcommands: records-cost, records-store, store-faults, store-volume.
"""
