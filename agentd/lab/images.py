"""The images the container lab runs, built with or without a registry.

With a registry the Dockerfile starts from ``python:3.11-slim-bookworm`` and etcd is
``quay.io/coreos/etcd``, as compose.yaml says by default.  Without one (this machine, CI, an
air-gapped host) everything comes from Debian's packages and PyPI's wheels, fetched on the
host through their ordinary clients:

* the **base image**: ``mmdebstrap --variant=minbase --include=<BASE_PACKAGES> bookworm`` makes
  a root file system tarball (about a minute, cached under ``/var/cache/agentd-images`` by the
  digest of the package list), which ``docker import`` turns into ``agentd-base:<digest>``.
  It has Python, the compilers the Dockerfile builds the data plane with, the CNI plugins,
  systemd and HAProxy (for docker/systemd.Dockerfile) and Debian's ``etcd-server``, so the
  same image is the compose lab's etcd;
* the **Python dependencies**: ``pip download`` of pyproject.toml's dependencies and build
  requirements into docker/wheels/, which the Dockerfile installs from with ``--no-index``
  (``PIP_OFFLINE=1``);
* a **busybox image** for plain ``docker run`` containers on lab nodes (``agentd lab up
  --docker``): Debian's static busybox and its applet links, ``docker import``-ed (2 MB).

Then ``docker build`` with ``--build-arg BASE=agentd-base:<digest>``: the same Dockerfile.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import sys
import tarfile
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from agentd.lab.dockerd import DockerEngine, DockerTimeout, run_client
from agentd.lab.errors import LabError

ROOT = Path(__file__).resolve().parents[2]  # the checkout: Dockerfile, compose.yaml, docker/
IMAGE_CACHE = Path(os.environ.get("AGENTD_IMAGE_CACHE", "/var/cache/agentd-images"))
SUITE = "bookworm"
BASE_PACKAGES = (
    # what the Dockerfile installs when the base lacks it, and what it builds with
    "python3", "python3-venv", "python3-dev", "gcc", "libc6-dev", "clang-16", "libbpf-dev",
    "iproute2", "containernetworking-plugins", "iputils-ping", "util-linux", "mount", "procps",
    "libnftables1", "nftables",
    # the compose lab's etcd, and systemd for the unit's test (docker/systemd.Dockerfile),
    # with HAProxy for its Ingress part ([ingress] enabled under the unit and its drop-in)
    "etcd-server", "systemd", "systemd-sysv", "haproxy",
)  # fmt: skip
REGISTRY_BASE = "python:3.11-slim-bookworm"
REGISTRY_ETCD = "quay.io/coreos/etcd:v3.5.17"
AGENT_IMAGE = "agentd:latest"
SYSTEMD_IMAGE = "agentd-systemd:latest"
BUSYBOX_IMAGE = "agentd-busybox:local"
BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static


def _digest(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


BASE_DIGEST = _digest(SUITE, *BASE_PACKAGES)
LOCAL_BASE = f"agentd-base:{BASE_DIGEST}"


@dataclass(frozen=True)
class Images:
    """What a compose project or a test runs: image names as the engine knows them."""

    agent: str
    etcd: str
    systemd: str | None
    base: str
    offline: bool

    def compose_env(self) -> dict[str, str]:
        """compose.yaml's variables for these images."""
        return {"ETCD_IMAGE": self.etcd, "AGENTD_BASE_IMAGE": self.base, "AGENTD_PIP_OFFLINE": "1" if self.offline else ""}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder at a time per cached file (two test runs on one machine share the cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(path.suffix + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def base_tarball(progress: Callable[[str], None] = lambda line: None) -> Path:
    """The base root file system, made by mmdebstrap once and cached."""
    tar = IMAGE_CACHE / f"base-{BASE_DIGEST}.tar"
    with _locked(tar):
        if tar.is_file():
            return tar
        _remove(tar)  # a directory an earlier mmdebstrap made of it (below): not a tarball
        progress(f"making the base image from Debian {SUITE} packages (mmdebstrap, about a minute)")
        tmp = tar.with_suffix(".tar.part")
        _remove(tmp)
        # --format=tar: mmdebstrap takes the format from the target's name otherwise, and makes
        # a directory of a name it does not know (".part").
        proc = run_client(
            ["mmdebstrap", "--variant=minbase", "--format=tar", "--include=" + ",".join(BASE_PACKAGES), SUITE,
             str(tmp)],
            "mmdebstrap", timeout=1800,
        )  # fmt: skip
        if proc.returncode != 0 or not tmp.is_file():
            _remove(tmp)
            raise LabError(f"mmdebstrap failed: {proc.stderr.strip()[-2000:] or 'it made no tarball'}")
        tmp.rename(tar)
    return tar


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def busybox_tarball() -> Path:
    """/bin/busybox and a link per applet (sh, ping, nc, ip, httpd...): a 2 MB root file system."""
    if not BUSYBOX.exists():
        raise LabError(f"{BUSYBOX} is missing: apt-get install busybox-static (scripts/dev setup does)")
    tar = IMAGE_CACHE / f"busybox-{_digest(str(BUSYBOX.stat().st_size), str(BUSYBOX.stat().st_mtime_ns))}.tar"
    with _locked(tar):
        if tar.exists():
            return tar
        listed = run_client([str(BUSYBOX), "--list"], f"{BUSYBOX} --list", timeout=60)
        applets = listed.stdout.split()
        if listed.returncode != 0 or not applets:
            raise LabError(f"{BUSYBOX} --list exited {listed.returncode} listing {len(applets)} applets: "
                           f"{listed.stderr.strip()[-500:]}")
        tmp = tar.with_suffix(".tar.part")
        with tarfile.open(tmp, "w") as out:
            for d in ("bin", "etc", "tmp", "proc", "sys", "dev", "root"):
                info = tarfile.TarInfo(d)
                info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
                out.addfile(info)
            out.add(str(BUSYBOX), "bin/busybox")
            for applet in applets:
                if applet != "busybox":
                    info = tarfile.TarInfo(f"bin/{applet}")
                    info.type, info.linkname = tarfile.SYMTYPE, "busybox"
                    out.addfile(info)
        tmp.rename(tar)
    return tar


def has_image(engine: DockerEngine, name: str) -> bool:
    return engine.docker("image", "inspect", name, check=False, timeout=60).returncode == 0


def import_image(engine: DockerEngine, tar: Path, name: str, *, cmd: str = '["/bin/sh"]') -> str:
    if not has_image(engine, name):
        engine.docker("import", "--change", f"CMD {cmd}", str(tar), name, timeout=600)
    return name


def local_base(engine: DockerEngine, progress: Callable[[str], None] = lambda line: None) -> str:
    """``agentd-base:<digest>`` in ``engine``, imported from the cached tarball if missing."""
    if not has_image(engine, LOCAL_BASE):
        tar = base_tarball(progress)
        progress(f"importing {tar.name} as {LOCAL_BASE}")
        import_image(engine, tar, LOCAL_BASE, cmd='["/bin/bash"]')
    return LOCAL_BASE


def busybox_image(engine: DockerEngine) -> str:
    return import_image(engine, busybox_tarball(), BUSYBOX_IMAGE)


def python_requirements() -> list[str]:
    """pyproject.toml's build requirements and run-time dependencies."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(project["build-system"]["requires"]) + list(project["project"]["dependencies"])


# The image's interpreter and C library (Debian bookworm's python3 and glibc), which the wheels
# must fit -- not the host's: a 3.12 venv or a newer glibc fetched wheels the image cannot use.
IMAGE_PYTHON = ("3.11", "cp", "cp311")
IMAGE_GLIBC_MINOR = 36


def wheel_target(machine: str | None = None) -> list[str]:
    """``pip download``'s flags for the image's interpreter and platform (manylinux up to
    bookworm's glibc 2.36; the host's architecture, the engine's)."""
    arch = machine or platform.machine()
    version, implementation, abi = IMAGE_PYTHON
    platforms = [f"manylinux_2_{minor}_{arch}" for minor in range(IMAGE_GLIBC_MINOR, 16, -1)]
    platforms.append(f"manylinux2014_{arch}")  # pip adds manylinux2010 and manylinux1 to it
    return ["--python-version", version, "--implementation", implementation, "--abi", abi,
            *(word for p in platforms for word in ("--platform", p))]  # fmt: skip


def fetch_wheels(dest: Path | None = None) -> Path:
    """Wheels of every Python requirement into docker/wheels/ (the Dockerfile's offline source),
    for the image's interpreter and platform (:func:`wheel_target`)."""
    dest = dest or ROOT / "docker" / "wheels"
    base = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", *wheel_target(),
            "--dest", str(dest)]  # fmt: skip
    # Already there from an earlier build: then the index is not asked at all.
    local = run_client([*base, "--no-index", "--find-links", str(dest), *python_requirements()],
                       "pip download (from docker/wheels/)", timeout=300)  # fmt: skip
    if local.returncode == 0:
        return dest
    proc = run_client([*base, *python_requirements()], "pip download", timeout=900)
    if proc.returncode != 0:
        raise LabError(f"pip download of the Python dependencies failed: {proc.stderr.strip()[-2000:]}")
    return dest


def registry_reachable(engine: DockerEngine) -> bool:
    """Does ``engine`` reach the registry: a pull of the slim Python image succeeds.  The image
    cached from an earlier run says nothing: without a registry the Dockerfile's apt-get and
    pip install, and docker-compose's etcd pull, fail all the same.  AGENTD_LOCAL_BASE=1 says no."""
    if os.environ.get("AGENTD_LOCAL_BASE") == "1":
        return False
    try:
        return engine.docker("pull", "--quiet", REGISTRY_BASE, check=False, timeout=120).returncode == 0
    except DockerTimeout:
        return False


def build_images(
    engine: DockerEngine,
    *,
    systemd: bool = False,
    rebuild: bool = True,
    progress: Callable[[str], None] = lambda line: None,
) -> Images:
    """Build the agent's image (and, with ``systemd``, the systemd one) in ``engine``, from the
    registry's base if the engine reaches it, else from the local one.  ``rebuild`` False keeps
    images already there (a private engine's data root kept between ``up``s)."""
    if not (ROOT / "Dockerfile").exists():
        raise LabError(f"no Dockerfile in {ROOT}: the container lab runs from a checkout")
    offline = not registry_reachable(engine)
    if offline:
        base, etcd = local_base(engine, progress), LOCAL_BASE
        progress("no registry: the Python dependencies as wheels (pip download into docker/wheels/)")
        fetch_wheels()
    else:
        base, etcd = REGISTRY_BASE, REGISTRY_ETCD
    images = Images(agent=AGENT_IMAGE, etcd=etcd, systemd=SYSTEMD_IMAGE if systemd else None, base=base, offline=offline)
    if rebuild or not has_image(engine, AGENT_IMAGE):
        progress(f"building {AGENT_IMAGE} from {base}")
        args = ["--build-arg", f"BASE={base}"] + (["--build-arg", "PIP_OFFLINE=1"] if offline else [])
        engine.docker("build", "--quiet", *args, "-t", AGENT_IMAGE, str(ROOT), timeout=1800)
    if systemd and (rebuild or not has_image(engine, SYSTEMD_IMAGE)):
        progress(f"building {SYSTEMD_IMAGE}")
        build_systemd_image(engine)
    return images


def build_systemd_image(engine: DockerEngine) -> str:
    """docker/systemd.Dockerfile on top of the agent's image (which must be there)."""
    engine.docker(
        "build", "--quiet", "-f", str(ROOT / "docker" / "systemd.Dockerfile"),
        "--build-arg", f"AGENTD_IMAGE={AGENT_IMAGE}", "-t", SYSTEMD_IMAGE, str(ROOT), timeout=1800,
    )  # fmt: skip
    return SYSTEMD_IMAGE
