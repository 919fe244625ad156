"""Runs llama.cpp's own HTTP server (prebuilt, from the xllamacpp wheel) until terminated.

    python tests/engines/llama_server.py MODEL.gguf PORT [--no-cache]
"""
from __future__ import annotations

import argparse
import signal
import threading

import xllamacpp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("port", type=int)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.model_alias = "tiny-llama"
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.n_ctx = args.ctx
    params.n_parallel = args.parallel
    params.endpoint_metrics = True
    params.cache_prompt = False  # a repeated prompt must not skip prefill
    params.warmup = False
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    server = xllamacpp.Server(params)
    print(f"llama.cpp server on {server.listening_address}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()


if __name__ == "__main__":
    main()
