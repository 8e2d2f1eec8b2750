# changestreamer: one process, one uvicorn worker (the change-streamer keeps its
# subscribers in memory, so it must not be forked).
#
# Two stages: `build` has a C compiler and builds the wheel, whose C helpers are
# optional extensions of the package build (setup.py; docs/architecture.md,
# decision 37); the runtime stage installs that wheel and has no compiler.
# tests/test_dockerfile.py replays the build stage from exactly what its COPY lines copy.

FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY app ./app
COPY migrations ./migrations
RUN python -m pip wheel --no-cache-dir --no-deps -w dist .

FROM python:3.11-slim
# Outside NODE_ENV=development the service refuses to start without
# ZERO_ADMIN_PASSWORD (it guards /statz and /profile): pass one with `-e`.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    ZERO_CHANGE_STREAMER_HOST=0.0.0.0 \
    ZERO_REPLICA_FILE=/data/zero.db
COPY --from=build /src/dist/ /tmp/dist/
RUN pip install --no-cache-dir /tmp/dist/*.whl && rm -rf /tmp/dist \
    && useradd --system --uid 10001 --user-group --home-dir /srv/changestreamer \
       --create-home changestreamer \
    && mkdir -p /data && chown changestreamer:changestreamer /data
USER changestreamer
WORKDIR /srv/changestreamer

VOLUME /data
EXPOSE 4849
# /ready: 200 once the service streams (and, with backups, once the backup covers
# the replica); 503 before. The start period covers an initial sync.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:4849/ready', timeout=2)"
CMD ["changestreamer", "serve"]
