# syntax=docker/dockerfile:1
#
# The `kedge` image: one binary for every service kind (`kedge serve intake|step|tool|…`), the
# operator's CLI and `kedge nats-config`. compose.yaml builds it; docs/RUNBOOK.md "Deployment".
#
#   docker build -t kedge:0.1.0 .
#
# Base images are pinned to a version; pin them to a digest too (`image@sha256:…`) where your
# registry policy asks for it. The build stage and the runtime stage are the same Debian release
# (bookworm), so the binary links against the glibc it runs on.

# ---- build ------------------------------------------------------------------------------------
FROM rust:1.95.0-slim-bookworm AS build
WORKDIR /src
# Everything the workspace needs to compile (the broker layout under nats/ and the JSON Schemas
# under schemas/ are compiled into the binary); .dockerignore keeps target/ and local state out.
COPY . .
# The registry and target caches survive between builds (BuildKit); the binary is copied out of
# the cached target/ so the next stage can take it. --locked: exactly the reviewed Cargo.lock.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kedge \
    && install -m 0755 target/release/kedge /usr/local/bin/kedge

# ---- runtime ----------------------------------------------------------------------------------
FROM debian:12.12-slim AS runtime
# bubblewrap: the tool service's sandbox for `shell` (it refuses to start without a working
# one; compose.yaml gives the tool containers what bwrap needs). ca-certificates: HTTPS to the
# model providers. util-linux (prlimit) is part of the base image.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        bubblewrap ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# A fixed non-root user. The directories a named volume is mounted on are created here, owned by
# it, so that a fresh volume starts out writable by the kedge user (Docker copies the image
# directory's ownership into an empty named volume).
RUN groupadd --system --gid 10001 kedge \
    && useradd --system --uid 10001 --gid kedge --home-dir /var/lib/kedge \
        --shell /usr/sbin/nologin kedge \
    && mkdir -p /var/lib/kedge/workspaces /etc/kedge/nats \
    && chown -R kedge:kedge /var/lib/kedge /etc/kedge/nats
COPY --from=build /usr/local/bin/kedge /usr/local/bin/kedge
USER kedge:kedge
WORKDIR /var/lib/kedge
ENV KEDGE_LOG=info
ENTRYPOINT ["kedge"]
CMD ["--help"]
