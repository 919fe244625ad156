"""The wire formats, below everything that reads them: a response's events and bodies as one shape (chunk.py), SSE
and other framings (sse.py, framing.py), content encodings (compression.py), the engines' own timing fields
(engine.py), a prompt's size and links (prompt.py), token counts (tokens.py) and text made safe to store (text.py).
No module here imports another folder: the dialects (apis/), measurement and the fleet read what these make.
"""
