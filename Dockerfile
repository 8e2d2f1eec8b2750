# changestreamer: one process, one uvicorn worker (the change-streamer keeps its
# subscribers in memory, so it must not be forked).
FROM python:3.11-slim

# Outside NODE_ENV=development the service refuses to start without
# ZERO_ADMIN_PASSWORD (it guards /statz and /profile): pass one with `-e`.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    ZERO_CHANGE_STREAMER_HOST=0.0.0.0 \
    ZERO_REPLICA_FILE=/data/zero.db
WORKDIR /srv/changestreamer

COPY pyproject.toml README.md alembic.ini ./
COPY app ./app
COPY migrations ./migrations
COPY scripts/build-speedups ./scripts/
# The C helpers (app/protocol/_jsscan.c, app/server/_wsfast.c, app/streamer/_rowrun.c,
# app/streamer/_fanout.c;
# docs/architecture.md decisions 31, 32, 34): compiled with a compiler that is removed
# again; the wheel takes the .so files as artifacts.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && scripts/build-speedups python \
    && pip install --no-cache-dir . \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y \
    && rm -rf /var/lib/apt/lists/*

VOLUME /data
EXPOSE 4849
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:4849/')"
CMD ["changestreamer", "serve"]
