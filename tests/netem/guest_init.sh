#!/bin/sh
# PID 1 of the user-mode-linux guest that run_uml.sh boots over the host's filesystem (read-only):
# mounts what a Linux userland needs, loads the shaping modules, runs the command in
# build/netem/guest.cmd from the checkout (mounted read-write), writes its exit status to
# build/netem/status and powers off.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/tmp LANG=C.UTF-8
repo=$(cd "$(dirname "$0")/../.." && pwd)
out="$repo/build/netem"

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=755 tmpfs /run          # /var/run is /run: holds /run/netns
mkdir -p /run/netns /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
# A checkout under /tmp or /run is hidden by the tmpfs just mounted there: its mount point is
# made in the tmpfs (elsewhere it exists already, on the read-only root).
mkdir -p "$repo"
mount -t hostfs -o "$repo" none "$repo"         # the checkout, writable (the rest stays read-only)
hostname netem-guest

# insmod each module after its dependencies (modules.dep lists them, the first needed last), from
# the booted kernel's module tree: run_uml.sh names it in guest.env (Debian's under
# /usr/lib/uml/modules, or a newer kernel's under build/uml/).
. "$out/guest.env"
load() {
    deps=$(sed -n "s|^\(kernel/.*/$1\.ko\): *||p" "$mods/modules.dep")
    for d in $(echo "$deps" | tr ' ' '\n' | tac); do
        grep -q "^$(basename "$d" .ko | tr - _) " /proc/modules || insmod "$mods/$d"
    done
    grep -q "^$1 " /proc/modules || insmod "$mods/$(sed -n "s|^\(kernel/.*/$1\.ko\):.*|\1|p" "$mods/modules.dep")"
}
for m in veth bridge tun sch_htb sch_netem cls_u32 tcp_bbr; do
    load "$m" || echo "guest: cannot load module $m"
done
ip link set lo up

cd "$repo"
sh "$out/guest.cmd" 2>&1
rc=$?
echo "$rc" > "$out/status"
sync
poweroff -f
