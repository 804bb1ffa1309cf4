from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture
def is_root() -> bool:
    return os.geteuid() == 0
