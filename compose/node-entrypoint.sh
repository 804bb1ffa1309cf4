#!/bin/sh
# Entrypoint of the lab's swarm node (compose/node.Dockerfile). The node runs with every capability
# but CAP_SYS_RESOURCE rather than --privileged (a host whose bounding set lacks one cannot start a
# privileged container), so /sys, /proc/sys and the cgroup hierarchies come read-only: a Docker
# engine needs them writable (ip_forward, its containers' cgroups). With a private cgroup namespace
# the hierarchies are the node's own, and /proc/sys is the node's network namespace's.
set -eu
mount -o remount,rw /sys
mount -o remount,rw,bind /proc/sys
for m in $(awk '$3 == "cgroup" { print $2 }' /proc/mounts); do
    mount -o remount,bind,rw "$m"
done
exec dockerd "$@"
