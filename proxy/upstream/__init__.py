"""The upstream connection and its network: one keep-alive HTTP/1.1 connection (connection.py), the pool of them
to one upstream with each network step timed (pool.py), the forward proxy it may go through (egress.py), the
descriptors the process holds (limits.py), and the hot loop that moves a response's bytes to the client
(reader.py, pump.py). It knows nothing of the fleet: the fleet owns a pool per replica (fleet/replica.py).
"""
