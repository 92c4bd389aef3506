# syntax=docker/dockerfile:1
# meshca container image: `docker build -t meshca .`
# Build stage: the release binary from the locked dependency graph. protox compiles the proto in
# build.rs (no protoc needed); cmake is only insurance for aws-lc-sys on unusual targets.
FROM rust:1-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The commit meshca_build_info reports (.git is not in the build context):
# docker build --build-arg MESHCA_BUILD_COMMIT=$(git rev-parse --short=12 HEAD) .
ARG MESHCA_BUILD_COMMIT=unknown
COPY . .
# Cache mounts keep the registry and target dir between builds; the binary is copied out of the
# cached target dir in the same step.
# Only `meshca`, without features: the load generator (meshca-bench, `bench` feature), which signs
# client certificates outside the audit log, and the test helpers are never compiled into the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin meshca \
 && install -m 0755 target/release/meshca /meshca

# Runtime: glibc + libgcc + CA certificates and nothing else, running as uid/gid 65532.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /meshca /usr/local/bin/meshca
USER 65532:65532
# 15012: IstioCertificateService (gRPC over TLS); 15014: /healthz, /readyz, metrics.
EXPOSE 15012 15014
ENTRYPOINT ["/usr/local/bin/meshca"]
CMD ["serve"]
