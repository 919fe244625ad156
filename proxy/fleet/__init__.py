"""The fleet's decisions: which replica takes a request (routes.py, picker.py: filter, score, pick), whether a
replica is set aside (health.py), how long it will take to answer (forecast.py), what its prefix cache holds
(prefix.py), a route's retries and their budget (retry.py, window.py), and a request's attempts across replicas
(placement.py). A replica (replica.py) is the fleet's object: its pool (upstream/pool.py) and what was learned of it.
"""
