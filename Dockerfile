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
COPY constraints.txt ./
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
COPY --from=build /src/constraints.txt /tmp/constraints.txt
# The dependencies at the versions tested (constraints.txt), as CI installs them.
RUN pip install --no-cache-dir -c /tmp/constraints.txt /tmp/dist/*.whl \
    && rm -rf /tmp/dist /tmp/constraints.txt \
    && useradd --system --uid 10001 --user-group --home-dir /srv/changestreamer \
       --create-home changestreamer \
    && mkdir -p /data && chown changestreamer:changestreamer /data
USER changestreamer
WORKDIR /srv/changestreamer

VOLUME /data
EXPOSE 4849
# Liveness (/), not readiness (/ready): a long initial sync or a wedged backup makes
# the service not ready, not unhealthy, and Docker must not act on it. The port is
# serve's: ZERO_CHANGE_STREAMER_PORT, else ZERO_PORT + 1.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD python -c "import os, urllib.request; port = os.environ.get('ZERO_CHANGE_STREAMER_PORT') or int(os.environ.get('ZERO_PORT') or 4848) + 1; urllib.request.urlopen(f'http://127.0.0.1:{port}/', timeout=2)"
CMD ["changestreamer", "serve"]
