#!/usr/bin/env bash
# Build the testbed's base image without any container registry:
#   debootstrap (minbase) -> chroot apt-get install python3 & co -> tar | docker import.
#
# Usage: compose/bootstrap-base.sh [--force]
#   --force   rebuild even if the image already exists (default: skip when it exists)
#
# Environment (all optional):
#   BASE_TAG               image to create              (prfaas-testbed-base:bookworm)
#   DEBIAN_SUITE           Debian suite                 (bookworm; its python3 is 3.11)
#   DEBIAN_MIRROR          Debian mirror                (http://deb.debian.org/debian)
#   DEBIAN_SECURITY_MIRROR security mirror, "" = none   (http://deb.debian.org/debian-security)
#   DEBIAN_ARCH            architecture                 (dpkg --print-architecture)
#   NICE                   niceness of the heavy steps  (10)
#   TMPDIR                 where the root file system is assembled (/var/tmp)
#
# Needs root, debootstrap (apt-get install debootstrap) and a reachable Docker engine.
set -euo pipefail

BASE_TAG=${BASE_TAG:-prfaas-testbed-base:bookworm}
DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR-http://deb.debian.org/debian-security}
NICE=${NICE:-10}
PACKAGES="python3 python3-venv python3-pip iproute2 ca-certificates"

force=0
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "bootstrap-base: unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done

log() { printf 'bootstrap-base: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

docker info >/dev/null 2>&1 || die "the Docker engine is not reachable ('docker info' failed)"
if [ "$force" = 0 ] && docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
    log "$BASE_TAG already exists; nothing to do (--force rebuilds it)"
    exit 0
fi
[ "$(id -u)" = 0 ] || die "must run as root (debootstrap and chroot)"
if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap from Debian's packages"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; } \
        || die "debootstrap is missing and could not be installed (apt-get install debootstrap)"
fi
DEBIAN_ARCH=${DEBIAN_ARCH:-$(dpkg --print-architecture 2>/dev/null || echo amd64)}

t_start=$EPOCHREALTIME
t_step=$t_start
elapsed() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
step_done() { log "$1 took $(elapsed "$t_step") s"; t_step=$EPOCHREALTIME; }

root=$(mktemp -d "${TMPDIR:-/var/tmp}/prfaas-base.XXXXXX")
cleanup() {
    local rc=$?
    for m in "$root/proc" "$root/sys" "$root/dev/pts"; do
        if mountpoint -q "$m" 2>/dev/null; then umount "$m" 2>/dev/null || umount -l "$m" || true; fi
    done
    # --one-file-system: never follow a mount that failed to come off into the host.
    rm -rf --one-file-system "$root"
    [ "$rc" = 0 ] || log "failed (exit $rc) after $(elapsed "$t_start") s; removed $root"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

log "debootstrap --variant=minbase $DEBIAN_SUITE ($DEBIAN_ARCH) from $DEBIAN_MIRROR into $root"
nice -n "$NICE" debootstrap --variant=minbase --arch="$DEBIAN_ARCH" "$DEBIAN_SUITE" "$root" "$DEBIAN_MIRROR" >"$root.log" 2>&1 \
    || { tail -n 30 "$root.log" >&2; rm -f "$root.log"; die "debootstrap failed"; }
rm -f "$root.log"
step_done "debootstrap"

# Sources with updates and security fixes; keep docs, man pages and translations out of the image
# (as Debian's own slim images do; copyright files stay).
{
    echo "deb $DEBIAN_MIRROR $DEBIAN_SUITE main"
    echo "deb $DEBIAN_MIRROR $DEBIAN_SUITE-updates main"
    if [ -n "$DEBIAN_SECURITY_MIRROR" ]; then echo "deb $DEBIAN_SECURITY_MIRROR $DEBIAN_SUITE-security main"; fi
} >"$root/etc/apt/sources.list"
cat >"$root/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
cat >"$root/etc/apt/apt.conf.d/docker-slim" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
EOF
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"   # never start services in the chroot
chmod 755 "$root/usr/sbin/policy-rc.d"
cp -L /etc/resolv.conf "$root/etc/resolv.conf"
mount -t proc proc "$root/proc"

log "chroot: apt-get install $PACKAGES"
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 \
    nice -n "$NICE" sh -euc "
        apt-get update -q
        apt-get upgrade -y -q
        apt-get install -y -q $PACKAGES
        apt-get clean
        python3 --version
    " >"$root/tmp/apt.log" 2>&1 || { tail -n 30 "$root/tmp/apt.log" >&2; die "chroot apt-get failed"; }
grep -E '^Python ' "$root/tmp/apt.log" | sed 's/^/bootstrap-base: /' >&2 || true
step_done "chroot apt-get install"

umount "$root/proc"
rm -f "$root/usr/sbin/policy-rc.d" "$root/etc/resolv.conf"
: >"$root/etc/resolv.conf"    # Docker bind-mounts its own at run time
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/cache/debconf/*-old \
    "$root"/var/log/* "$root"/tmp/* "$root"/var/tmp/* "$root"/root/.cache \
    "$root"/usr/share/doc/*/changelog* "$root"/usr/share/man/* "$root"/usr/share/locale/*
# Stale or partial bytecode out; compose/Dockerfile compiles the standard library afresh.
find "$root/usr/lib" -name __pycache__ -type d -prune -exec rm -rf {} +
mkdir -p "$root/var/lib/apt/lists/partial" "$root/var/cache/apt/archives/partial"
log "root file system: $(du -sh --one-file-system "$root" | cut -f1)"

log "docker import -> $BASE_TAG"
# Device nodes and pseudo file systems are the engine's business at run time.
nice -n "$NICE" tar --numeric-owner --xattrs -C "$root" \
    --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -c . \
  | docker import \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["python3"]' \
        --change "LABEL org.opencontainers.image.description=\"Debian $DEBIAN_SUITE minbase + $PACKAGES (debootstrap, prfaas-testbed)\"" \
        --change "LABEL io.prfaas-testbed.base.mirror=$DEBIAN_MIRROR" \
        --message "prfaas-testbed bootstrap-base.sh: debootstrap $DEBIAN_SUITE" \
        - "$BASE_TAG" >/dev/null
step_done "tar | docker import"
log "built $BASE_TAG ($(docker image inspect -f '{{.Size}}' "$BASE_TAG" | awk '{ printf "%.0f MB", $1 / 1e6 }')) in $(elapsed "$t_start") s"
