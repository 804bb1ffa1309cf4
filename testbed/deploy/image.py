"""The testbed's container image: one image for every role, built offline from a source checkout.

`ensure_image()` returns at once when `IMAGE` carries the hash of the current sources in its
`SOURCE_LABEL`; otherwise it builds the base if missing (compose/bootstrap-base.sh: debootstrap +
docker import, no registry), the wheelhouse (compose/build-wheelhouse.sh) and the image
(compose/Dockerfile). Inspect, build and prune go through the engine's API
(`testbed.deploy.engine`); the base and the wheelhouse are shell scripts (debootstrap, pip) run
as child processes (testbed.net.procs), their output streamed line by line like the build's.

`python -m testbed.deploy.image [--rebuild | --hash]` builds (or prints the source hash).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from testbed.config.privilege import is_root
from testbed.deploy.base import BackendError
from testbed.deploy.engine import Engine, connect
from testbed.net.procs import run_streamed

IMAGE = "prfaas-testbed:latest"
BASE = "prfaas-testbed-base:bookworm"
SOURCE_LABEL = "io.prfaas-testbed.source-hash"
STAGE_LABEL = "io.prfaas-testbed.stage"  # on the Dockerfile's intermediate (install) stage
REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = "compose/Dockerfile"
# Everything that goes into the image (or decides how): a change to any of these rebuilds it.
SOURCE_GLOBS = (
    "testbed/**/*.py",
    "pyproject.toml",
    DOCKERFILE,
    ".dockerignore",
    "scenarios/**/*.yaml",
    "netem_profiles/**/*.yaml",
    "traces/samples/**/*",
)
# A health probe of a service for use by hand (`docker run --health-cmd`, see the Dockerfile):
# exit 0 when the URL answers 2xx, 1 otherwise. The backends' own check is compose.HEALTH_CMD.
HEALTHCHECK_CODE = "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)"
TAIL_LINES = 30


class ImageError(BackendError):
    """The engine is unreachable or a build step failed; the message ends with its last output lines."""


@contextmanager
def _image_errors() -> Iterator[None]:
    """The engine's errors (BackendError) as ImageError, the error this module promises."""
    try:
        yield
    except ImageError:
        raise
    except BackendError as e:
        raise ImageError(str(e)) from e


def source_files(root: Path = REPO_ROOT) -> list[Path]:
    """The files `source_hash` covers, relative to `root`, sorted (no caches, no hidden files)."""
    found: set[Path] = set()
    for pattern in SOURCE_GLOBS:
        for p in root.glob(pattern):
            rel = p.relative_to(root)
            if p.is_file() and not any(part == "__pycache__" or part.startswith(".") for part in rel.parts[:-1]):
                found.add(rel)
    return sorted(found, key=lambda r: r.as_posix())


def source_hash(root: Path = REPO_ROOT) -> str:
    """SHA-256 over every source file's relative path and content (order- and mtime-independent)."""
    h = hashlib.sha256()
    for rel in source_files(root):
        data = (root / rel).read_bytes()
        h.update(rel.as_posix().encode() + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def _engine(engine: Engine | None) -> Engine:
    with _image_errors():
        return engine if engine is not None else connect()


def check_engine(engine: Engine | None = None) -> str:
    """The engine's version; ImageError when the engine cannot be reached."""
    with _image_errors():
        return _engine(engine).version()


def image_labels(image: str, engine: Engine | None = None) -> dict[str, str] | None:
    """The image's labels ({} when it has none), or None when there is no such image."""
    with _image_errors():
        return _engine(engine).image_labels(image)


def _stream(
    argv: Sequence[str], what: str, log: Callable[[str], None], cwd: Path, env: dict[str, str] | None = None
) -> None:
    """Run argv, passing each output line to log; ImageError with the last lines on failure."""
    try:
        rc, tail = run_streamed(argv, cwd, log, env, TAIL_LINES)
    except OSError as e:
        raise ImageError(f"{what}: cannot run {argv[0]}: {e.strerror}") from None
    if rc != 0:
        raise ImageError(f"{what} failed (exit {rc}); last lines:\n" + "\n".join(tail))


def _timed(
    what: str, log: Callable[[str], None], argv: Sequence[str], cwd: Path, env: dict[str, str] | None = None
) -> None:
    t0 = time.monotonic()
    log(f"image: {what} ...")
    _stream(argv, what, log, cwd, env)
    log(f"image: {what} took {time.monotonic() - t0:.1f} s")


def _build(engine: Engine, base: str, source: str, rebuild: bool, log: Callable[[str], None]) -> None:
    """The engine builds compose/Dockerfile from the repository root; each output line to log,
    ImageError with the last lines when a step fails."""
    what = f"build {IMAGE} (base {base})"
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    t0 = time.monotonic()
    log(f"image: {what} ...")
    try:
        for line in engine.build(
            REPO_ROOT, DOCKERFILE, IMAGE, {"BASE_IMAGE": base, "SOURCE_HASH": source}, nocache=rebuild
        ):
            tail.append(line)
            log(line)
    except BackendError as e:
        raise ImageError(f"{e}; last lines:\n" + "\n".join(tail)) from e
    log(f"image: {what} took {time.monotonic() - t0:.1f} s")


def ensure_image(rebuild: bool = False, log: Callable[[str], None] = print, engine: Engine | None = None) -> str:
    """Make sure `IMAGE` exists and matches the current sources; build what is missing. Returns IMAGE.

    The base is `BASE` (bootstrapped locally when missing) unless the `BASE_IMAGE` environment
    variable names another one (e.g. python:3.11-slim-bookworm, pulled by the build).
    `rebuild` rebuilds the image without the build cache (the base is kept).
    """
    engine = _engine(engine)
    check_engine(engine)
    want = source_hash()
    labels = image_labels(IMAGE, engine)
    if not rebuild and labels is not None and labels.get(SOURCE_LABEL) == want:
        log(f"image: {IMAGE} is up to date (sources {want[:12]})")
        return IMAGE
    if not (REPO_ROOT / DOCKERFILE).is_file():
        raise ImageError(f"building {IMAGE} needs the project's source checkout ({REPO_ROOT / DOCKERFILE} is missing)")
    log(
        f"image: building {IMAGE}: "
        + ("rebuild requested" if rebuild else "not built yet" if labels is None else "sources changed")
    )
    t0 = time.monotonic()
    base = os.environ.get("BASE_IMAGE") or BASE
    if base == BASE and image_labels(BASE, engine) is None:
        _timed(
            f"bootstrap base image {BASE}", log, ["bash", "compose/bootstrap-base.sh"], REPO_ROOT, {"BASE_TAG": BASE}
        )
    _timed("wheelhouse", log, ["bash", "compose/build-wheelhouse.sh"], REPO_ROOT)
    _build(engine, base, want, rebuild, log)
    got = (image_labels(IMAGE, engine) or {}).get(SOURCE_LABEL)
    if got != want:
        raise ImageError(f"built {IMAGE} but its {SOURCE_LABEL} label is {got!r}, expected {want!r}")
    _prune(engine, log)
    log(f"image: {IMAGE} ready in {time.monotonic() - t0:.1f} s")
    return IMAGE


def _prune(engine: Engine, log: Callable[[str], None]) -> None:
    """Remove our dangling images: the legacy builder's install stage and images this build replaced."""
    for label in (STAGE_LABEL, SOURCE_LABEL):
        try:
            engine.prune_images(label)
        except BackendError as e:
            log(f"image: pruning old images failed (ignored): {e}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m testbed.deploy.image",
        description="Build the testbed's container image if it is missing or stale.",
    )
    p.add_argument("--rebuild", action="store_true", help="rebuild even if up to date, without the build cache")
    p.add_argument("--hash", action="store_true", help="print the hash of the sources and exit")
    p.add_argument(
        "--if-possible",
        action="store_true",
        help="say so and exit 0 where no Docker engine answers or not root (`make test` builds "
        "the image ahead of the docker tier this way, which skips there too)",
    )
    args = p.parse_args(argv)
    if args.hash:
        print(source_hash())
        return 0
    if args.if_possible:
        from testbed.deploy.engine import try_connect

        if not is_root() or try_connect() is None:
            print("no Docker engine answers (or not root): the image is not built", flush=True)
            return 0
    try:
        ensure_image(rebuild=args.rebuild, log=lambda line: print(line, flush=True))
    except ImageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
