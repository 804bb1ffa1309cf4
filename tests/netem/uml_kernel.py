"""Choose the user-mode-linux kernel the netem tier boots, for run_uml.sh (stdlib only, host side).

    python tests/netem/uml_kernel.py BUILD_DIR     (prints shell assignments: uml, kver, mods)

Debian's `user-mode-linux` (/usr/bin/linux.uml) comes first: a probe boots it with a two-line
init. Where that guest cannot run on this host's CPU (the 6.1 and 6.12 UML kernels panic on a
host with AVX-512 under Linux 6.18 with `userspace - ptrace set fp regs failed, errno = 14`:
they cannot hand the host's larger FPU state to their processes), a newer user-mode-linux is
fetched from the Debian mirror into BUILD_DIR/<version>/ once: the version is pinned below,
the .deb's SHA256 is the one the mirror's Packages index lists. When that binary needs a newer
glibc than the host's, trixie's libc6 is fetched beside it and patchelf points the binary at it
(running it through the loader instead makes UML miscompute its memory).

One line on stderr says which kernel and why. Exit 0: the assignments are on stdout; 77: no
kernel can be had here (the reason on stderr; the tier skips); 1: something is wrong that a
skip would hide (a checksum mismatch, the pinned version gone from the index).
"""

from __future__ import annotations

import hashlib
import lzma
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# The newer kernel: a Debian version of `user-mode-linux` and the suites whose index may list it.
UML_VERSION = "7.2um1"
UML_SUITES = ("unstable", "testing")
LIBC_SUITE = "trixie"
MIRROR = os.environ.get("NETEM_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DEBIAN_UML = Path("/usr/bin/linux.uml")
DEBIAN_MODULES = Path("/usr/lib/uml/modules")
PROBE_INIT = Path(__file__).with_name("uml_probe.sh")
FP_PANIC = "ptrace set fp regs failed"
NEEDED_MODULES = ("veth", "sch_netem", "sch_htb")
SKIP, FAIL = 77, 1


class Skip(Exception):
    """Nothing can be had on this host: the tier skips with this reason."""


@dataclass
class Kernel:
    uml: Path
    kver: str
    mods: Path


def say(msg: str) -> None:
    print(f"run_uml: {msg}", file=sys.stderr, flush=True)


def modules_of(root: Path) -> tuple[str, Path]:
    trees = sorted(p for p in root.iterdir() if (p / "modules.dep").is_file()) if root.is_dir() else []
    if len(trees) != 1:
        raise Skip(f"expected one module tree under {root}, found {len(trees)}")
    dep = (trees[0] / "modules.dep").read_text()
    missing = [m for m in NEEDED_MODULES if not re.search(rf"/{m}\.ko(\.[gx]z|\.zst)?:", dep)]
    if missing:
        raise Skip(f"no {', '.join(missing)} module under {trees[0]}")
    return trees[0].name, trees[0]


def probe(uml: Path) -> tuple[bool, str]:
    """Boot `uml` with the probe init; (it came up, why not: the console's telling line)."""
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as work:
        cmd = [
            str(uml),
            "mem=64M",
            "root=/dev/root",
            "rootfstype=hostfs",
            "rootflags=/",
            "ro",
            "quiet",
            f"uml_dir={work}",
            f"init={PROBE_INIT}",
            "con0=fd:0,fd:1",
            "con=null",
        ]
        # A process group of its own: the guest's host threads are killed together on a timeout.
        p = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TMPDIR": work},
            start_new_session=True,
            text=True,
            errors="replace",
        )
        try:
            out, _ = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            return False, "the probe guest did not come up within 90 s"
    if "netem-probe: up" in out:
        return True, ""
    lines = [ln.strip() for ln in out.splitlines()]
    telling = (
        next((ln for ln in lines if FP_PANIC in ln), None)
        or next((ln for ln in lines if "Kernel panic" in ln), None)
        or (lines[-1] if lines else "no console output")
    )
    return False, telling


def fetch(url: str, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=30) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
    except (urllib.error.URLError, OSError) as e:
        tmp.unlink(missing_ok=True)
        raise Skip(f"cannot fetch {url}: {getattr(e, 'reason', e)}") from e
    tmp.replace(dest)


def stanza(suite: str, package: str, version: str | None, work: Path) -> dict[str, str] | None:
    """The Packages index entry of `package` (at `version`, or the one listed) in `suite`."""
    index = work / f"Packages-{suite}.xz"
    fetch(f"{MIRROR}/dists/{suite}/main/binary-amd64/Packages.xz", index)
    try:
        with lzma.open(index, "rt", encoding="utf-8", errors="replace") as f:
            fields: dict[str, str] = {}
            for line in f:
                if line.strip() == "":
                    if fields.get("Package") == package and version in (None, fields.get("Version")):
                        return fields
                    fields = {}
                elif not line[0].isspace() and ":" in line:
                    k, v = line.split(":", 1)
                    fields[k] = v.strip()
            return None
    finally:
        index.unlink(missing_ok=True)


def fetch_deb(entry: dict[str, str], work: Path) -> Path:
    deb = work / Path(entry["Filename"]).name
    fetch(f"{MIRROR}/{entry['Filename']}", deb)
    digest = hashlib.sha256(deb.read_bytes()).hexdigest()
    if digest != entry["SHA256"]:
        raise RuntimeError(f"{deb.name}: SHA256 {digest} is not the index's {entry['SHA256']}")
    return deb


def extract(deb: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.replace(dest)


def glibc_needed(binary: Path) -> tuple[int, ...]:
    # The versions a binary needs are named in its dynamic string table.
    found = {
        tuple(int(x) for x in m.split(b"."))
        for m in re.findall(rb"GLIBC_(2\.[0-9]+(?:\.[0-9]+)?)\x00", binary.read_bytes())
    }
    return max(found, default=(0,))


def glibc_host() -> tuple[int, ...]:
    v = os.confstr("CS_GNU_LIBC_VERSION") or "glibc 0"
    return tuple(int(x) for x in v.split()[1].split("."))


def dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def patchelf() -> str:
    found = shutil.which("patchelf")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        say("installing patchelf (apt)")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-qq", "patchelf"]
        if subprocess.run(install, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
            subprocess.run(install, env=env, capture_output=True)
        found = shutil.which("patchelf")
    if found is None:
        raise Skip("patchelf is needed and cannot be installed here (needs root and apt)")
    return found


def newer_kernel(build: Path) -> tuple[Kernel, str]:
    """The pinned user-mode-linux under build/<version>/, fetched and set up once."""
    home = build / UML_VERSION
    home.mkdir(parents=True, exist_ok=True)
    root = home / "root"
    binary = root / "usr/bin/linux.uml"
    if not binary.is_file():
        entry = next((e for s in UML_SUITES if (e := stanza(s, "user-mode-linux", UML_VERSION, home))), None)
        if entry is None:
            raise RuntimeError(
                f"user-mode-linux {UML_VERSION} is no longer in Debian's {'/'.join(UML_SUITES)} "
                "index: pin a listed version in tests/netem/uml_kernel.py"
            )
        deb = fetch_deb(entry, home)
        extract(deb, root)
        deb.unlink()
        say(f"fetched user-mode-linux {UML_VERSION} into {home} (SHA256 {entry['SHA256'][:16]}... checked)")
    kver, mods = modules_of(root / "usr/lib/uml/modules")
    need, have = glibc_needed(binary), glibc_host()
    if need <= have:
        return Kernel(binary, kver, mods), f"user-mode-linux {UML_VERSION} from Debian's mirror ({home})"
    glibc = home / "glibc"
    lib = glibc / "usr/lib/x86_64-linux-gnu"
    loader = lib / "ld-linux-x86-64.so.2"
    if not loader.exists():
        entry = stanza(LIBC_SUITE, "libc6", None, home)
        if entry is None:
            raise RuntimeError(f"no libc6 in Debian's {LIBC_SUITE} index")
        deb = fetch_deb(entry, home)
        extract(deb, glibc)
        deb.unlink()
        (glibc / "VERSION").write_text(entry["Version"] + "\n")
        say(f"fetched {LIBC_SUITE}'s libc6 {entry['Version']} into {glibc} (SHA256 checked)")
    libc_version = (glibc / "VERSION").read_text().strip()
    patched = home / "linux.uml"
    tool = patchelf()
    # Patched again where the checkout moved (the interpreter is an absolute path) or is new.
    current = subprocess.run([tool, "--print-interpreter", str(patched)], capture_output=True, text=True)
    if not patched.is_file() or current.stdout.strip() != str(loader):
        tmp = home / "linux.uml.part"
        shutil.copyfile(binary, tmp)
        tmp.chmod(0o755)
        subprocess.run([tool, "--set-interpreter", str(loader), "--set-rpath", str(lib), str(tmp)], check=True)
        tmp.replace(patched)
    return Kernel(patched, kver, mods), (
        f"user-mode-linux {UML_VERSION} from Debian's mirror ({home}), "
        f"with {LIBC_SUITE}'s libc6 {libc_version} (it needs glibc {dotted(need)}, "
        f"this host has {dotted(have)})"
    )


def choose(build: Path) -> Kernel:
    if not DEBIAN_UML.is_file():
        raise Skip(f"{DEBIAN_UML} not found (apt-get install user-mode-linux kmod)")
    kver, mods = modules_of(DEBIAN_MODULES)
    t0 = time.monotonic()
    up, why = probe(DEBIAN_UML)
    if up:
        say(
            f"kernel {kver}: Debian's user-mode-linux ({DEBIAN_UML}), it boots on this host "
            f"(probe {time.monotonic() - t0:.1f} s)"
        )
        return Kernel(DEBIAN_UML, kver, mods)
    cause = "cannot run on this CPU" if FP_PANIC in why else "does not boot here"
    try:
        k, what = newer_kernel(build)
    except Skip as e:
        raise Skip(f"Debian's kernel {kver} {cause} ({why}) and the newer one cannot be had: {e}") from e
    say(f"kernel {k.kver}: {what}, because Debian's {kver} {cause} ({why})")
    return k


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        k = choose(Path(sys.argv[1]).resolve())
    except Skip as e:
        say(f"skipped: {e}")
        return SKIP
    except (RuntimeError, subprocess.CalledProcessError, OSError, lzma.LZMAError) as e:
        say(f"no kernel: {e}")
        return FAIL
    print(f"uml={shlex.quote(str(k.uml))} kver={shlex.quote(k.kver)} mods={shlex.quote(str(k.mods))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
