"""Find or start the Docker daemon the compose targets and container tests use; build the images.

    python scripts/dockerhost.py host      # print DOCKER_HOST=... (starting a private daemon if needed)
    python scripts/dockerhost.py images    # the base image (cached by content key), fleet-gateway
    python scripts/dockerhost.py stop      # stop the private daemon this checkout started, by its pid

The daemon is, in order: `DOCKER_HOST` if it answers; else /var/run/docker.sock if it answers;
else a private dockerd (Debian's docker.io, installed with apt when missing) with vfs storage,
no bridge and no iptables, its socket at `.docker/docker.sock` in the checkout. Its data root
lies outside the checkout (FLEET_DOCKER_ROOT, default /var/lib/fleet-docker) so images stay
cached between runs on one machine; only one private daemon runs per machine, and a second
checkout uses the one already answering (its socket is recorded in the data root).

No registry is needed: the base image is made from Debian's packages with debootstrap and
`docker import`, tagged with a hash of what goes into it, so a second run reuses it. Its root
filesystem is made in FLEET_DOCKER_ROOT/tmp whichever daemon answers (the folder is created when
missing), as root, and kept as a tar (FLEET_BASE_CACHE, default /var/cache/fleet-base): another
daemon on the machine imports that in seconds instead of running debootstrap again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATE = Path(os.environ.get("FLEET_DOCKER_ROOT", "/var/lib/fleet-docker"))
SOCK = ROOT / ".docker" / "docker.sock"
PRIVATE_HOST = f"unix://{SOCK}"
PIDFILE = ROOT / ".docker" / "dockerd.pid"
LOG = ROOT / ".docker" / "dockerd.log"
# Debian release and packages of the base image: python for the fleet, redis-server for compose's
# redis on a machine that cannot pull redis:7.4-alpine. Part of the content key.
SUITE = "bookworm"
MIRROR = os.environ.get("FLEET_DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = ["python3", "python3-venv", "ca-certificates", "redis-server", "redis-tools", "libnuma1"]
BASE_REPO = "fleet-base"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# The base image's root filesystem as made once on this machine (a tar named by its content key):
# another daemon here (the user's own beside the private one, or a fresh data root) imports it in
# seconds instead of running debootstrap again. Outside FLEET_DOCKER_ROOT, which such a daemon lacks.
BASE_CACHE = Path(os.environ.get("FLEET_BASE_CACHE", "/var/cache/fleet-base"))
START_TIMEOUT_S = 60.0


def log(msg: str) -> None:
    print(f"dockerhost: {msg}", file=sys.stderr, flush=True)


def answers(host: str) -> bool:
    """A daemon answers `docker version` at this DOCKER_HOST within a few seconds."""
    try:
        r = subprocess.run(["docker", "-H", host, "version", "--format", "{{.Server.Version}}"],
                           capture_output=True, timeout=10)
    except (subprocess.TimeoutExpired, FileNotFoundError):
        return False
    return r.returncode == 0 and bool(r.stdout.strip())


def ensure_installed() -> None:
    """Debian's Engine, Compose v1, debootstrap and Prometheus, with apt, when any is missing (CI runs as root)."""
    need = [pkg for exe, pkg in (("/usr/sbin/dockerd", "docker.io"), ("/usr/bin/docker-compose", "docker-compose"),
                                 ("/usr/sbin/debootstrap", "debootstrap"),
                                 # Prometheus for the container tests' service discovery (run on the host)
                                 ("/usr/bin/prometheus", "prometheus")) if not Path(exe).exists()]
    if not need:
        return
    log(f"installing {' '.join(need)} with apt")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *need], check=True, env=env,
                   stdout=subprocess.DEVNULL)


def _pid_alive(pid: int) -> bool:
    try:
        return b"dockerd" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def start_private() -> str:
    """Start (or reuse) the machine's private dockerd; returns its DOCKER_HOST."""
    recorded = STATE / "socket"
    if recorded.exists():
        host = recorded.read_text().strip()
        if answers(host):
            return host
    ensure_installed()
    SOCK.parent.mkdir(exist_ok=True)
    (STATE / "data").mkdir(parents=True, exist_ok=True)
    host = PRIVATE_HOST
    if answers(host):
        return host
    SOCK.unlink(missing_ok=True)
    # exec-root holds containerd's sockets: a short path (unix sockets are limited to 108 bytes).
    cmd = ["/usr/sbin/dockerd", "--data-root", str(STATE / "data"), "--exec-root", "/run/fleet-docker",
           "-H", host, "--pidfile", str(PIDFILE), "--iptables=false", "--ip6tables=false",
           "--bridge=none", "--storage-driver=vfs"]
    with open(LOG, "ab") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise SystemExit(f"dockerd exited with {p.returncode}; see {LOG}")
        if answers(host):
            recorded.write_text(host + "\n")
            log(f"started a private dockerd (pid {p.pid}), socket {SOCK}")
            return host
        time.sleep(0.5)
    raise SystemExit(f"dockerd did not answer within {START_TIMEOUT_S:.0f} s; see {LOG}")


def resolve() -> str:
    """The DOCKER_HOST to use, in the order docs/operations.md gives."""
    env_host = os.environ.get("DOCKER_HOST")
    if env_host and answers(env_host):
        return env_host
    if Path("/var/run/docker.sock").exists() and answers("unix:///var/run/docker.sock"):
        return "unix:///var/run/docker.sock"
    return start_private()


def stop_private() -> None:
    """Stop the private daemon this checkout started: by the pid in its pidfile, never by name."""
    if not PIDFILE.exists():
        log("no private dockerd of this checkout")
        return
    pid = int(PIDFILE.read_text().strip() or 0)
    if pid and _pid_alive(pid):
        os.kill(pid, 15)
        deadline = time.monotonic() + 30
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        log(f"stopped dockerd (pid {pid})")
    (STATE / "socket").unlink(missing_ok=True)


def docker(host: str, *args: str, check: bool = True, **kw: object) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "DOCKER_HOST": host, "DOCKER_BUILDKIT": "0"}
    return subprocess.run(["docker", *args], check=check, env=env, **kw)  # type: ignore[call-overload]


def base_key() -> str:
    """The content key of the base image: release, mirror-independent package list, this script's
    recipe version, and the CA bundle baked in (builds here reach PyPI through it)."""
    h = hashlib.sha256()
    h.update(f"{SUITE}\n{' '.join(sorted(PACKAGES))}\nrecipe-1\n".encode())
    if HOST_CA.exists():
        h.update(HOST_CA.read_bytes())
    return h.hexdigest()[:12]


def scratch_dir() -> Path:
    """Where the base image's rootfs is made: FLEET_DOCKER_ROOT/tmp, created when missing. A daemon
    the user already runs never made the data root (only the private daemon's start does), and /tmp
    is often a small tmpfs or noexec, where debootstrap's chroot fails."""
    if os.geteuid() != 0:  # debootstrap makes device nodes and chroots: root only
        raise SystemExit(f"dockerhost: making the base image {BASE_REPO}:{base_key()} needs root (debootstrap): "
                         "run `make images` once as root (`sudo -E make images` keeps DOCKER_HOST)")
    d = STATE / "tmp"
    d.mkdir(parents=True, exist_ok=True)
    return d


def base_image(host: str) -> str:
    """`fleet-base:<key>` (also tagged fleet-base:latest) in the daemon at `host`: imported from the
    machine's kept root filesystem, which debootstrap makes when there is none."""
    tag = f"{BASE_REPO}:{base_key()}"
    if docker(host, "image", "inspect", tag, check=False, capture_output=True).returncode == 0:
        docker(host, "tag", tag, f"{BASE_REPO}:latest")
        log(f"base image {tag} cached")
        return tag
    t0 = time.monotonic()
    kept = BASE_CACHE / f"{base_key()}.tar"
    made = not kept.exists()
    if made:
        make_rootfs(kept)
    with open(kept, "rb") as tar:
        docker(host, "import", "--change", "ENV LANG=C.UTF-8", "-", tag, stdin=tar, stdout=subprocess.DEVNULL)
    docker(host, "tag", tag, f"{BASE_REPO}:latest")
    # Base images of older recipes: a vfs daemon keeps each whole, so they go (images built on them
    # stay usable until rebuilt).
    old = docker(host, "images", BASE_REPO, "--format", "{{.Repository}}:{{.Tag}}", capture_output=True, text=True)
    for name in old.stdout.split():
        if name not in (tag, f"{BASE_REPO}:latest"):
            docker(host, "rmi", name, check=False, capture_output=True)
    how = "made with debootstrap" if made else f"imported from {kept}"
    log(f"base image {tag} {how} in {time.monotonic() - t0:.0f} s")
    return tag


def make_rootfs(kept: Path) -> None:
    """The base image's root filesystem, made with debootstrap into `kept` (a tar)."""
    scratch = scratch_dir()
    ensure_installed()
    kept.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        rootfs = Path(tmp) / "rootfs"
        log(f"debootstrap {SUITE} with {', '.join(PACKAGES)} (about a minute)")
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
                        str(rootfs), MIRROR], check=True, stdout=subprocess.DEVNULL)
        # Builds here reach PyPI through a proxy only the host's bundle trusts: the image (local,
        # never pushed) carries that bundle; a GPU box builds on the CUDA image and needs none.
        if HOST_CA.exists():
            shutil.copyfile(HOST_CA, rootfs / "etc/ssl/certs/ca-certificates.crt")
        (rootfs / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
        for d in ("var/lib/apt/lists", "var/cache/apt/archives"):
            shutil.rmtree(rootfs / d, ignore_errors=True)
            (rootfs / d).mkdir(parents=True, exist_ok=True)
        # Written beside its final name, then renamed: a run killed midway leaves no half a tar.
        part = kept.with_suffix(".part")
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(part), "."], check=True)
        part.rename(kept)


def build(host: str, dockerfile: str, tag: str, base: str, *extra: str) -> None:
    t0 = time.monotonic()
    docker(host, "build", "--network", "host", "-f", str(ROOT / dockerfile), "--build-arg", f"BASE_IMAGE={base}",
           *extra, "-t", tag, str(ROOT), stdout=subprocess.DEVNULL if os.environ.get("QUIET") else None)
    log(f"{tag} built in {time.monotonic() - t0:.0f} s")


def images(host: str) -> None:
    base = base_image(host)
    build(host, "Dockerfile", "fleet-gateway:latest", base)
    if host == PRIVATE_HOST:  # our own daemon: the images a rebuild replaced take disk (vfs: whole copies)
        docker(host, "image", "prune", "-f", check=False, capture_output=True)


def dispatch(argv: list[str], commands: Mapping[str, Callable[[], None]], default: str, usage: str | None) -> int:
    """Run the command `argv[1]` names (`default` when none is given); an unknown one prints
    `usage` on stderr and exits 2. The scripts' shared `main`: this one's and scripts/compose.py's."""
    what = argv[1] if len(argv) > 1 else default
    if what not in commands:
        print(usage, file=sys.stderr)
        return 2
    commands[what]()
    return 0


def main(argv: list[str]) -> int:
    return dispatch(argv, {"host": lambda: print(f"DOCKER_HOST={resolve()}"),
                           "images": lambda: images(resolve()),
                           "stop": stop_private}, "host", __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
