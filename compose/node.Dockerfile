# A swarm node for the lab of testbed.deploy.swarm_lab: Debian's Docker engine (docker.io) on the
# project's debootstrap base, run privileged as one "host" of a multi-engine swarm on one machine.
# Built offline apart from Debian's package mirror (no registry):
#   docker build --build-arg BASE_IMAGE=prfaas-testbed-base:bookworm -t prfaas-testbed-node:TAG -f compose/node.Dockerfile compose
ARG BASE_IMAGE=prfaas-testbed-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io iptables ca-certificates \
    && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && dockerd --version
ARG NODE_HASH=unknown
LABEL io.prfaas-testbed.node-hash="${NODE_HASH}"
COPY node-entrypoint.sh /usr/local/bin/node-entrypoint
ENTRYPOINT ["/usr/local/bin/node-entrypoint"]
