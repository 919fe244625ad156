"""The serving path: the listener and the server (acceptor.py, server.py), the ASGI app and its endpoints (app.py),
what is let in (admission.py, tenants.py), each request relayed (request.py, relay.py, reply.py), and the /ui
page (page.py and its files). The entry points run this; it uses every folder below it.
"""
