#!/usr/bin/env bash
# Build the project's Docker image on a base made here, without any container registry, and train in it:
#   1. debootstrap a minimal Debian bookworm (Debian's packages) with python3 + venv; in a venv at /opt/venv install
#      torch's CPU build (the local file `pip install torch==2.13.0` takes on this machine, see TORCH_SPEC), the
#      torchvision release paired with it, and the project's dependencies (PyPI); `docker import` it as the base;
#   2. `docker build --build-arg BASE=<that base>` the project's own Dockerfile, unchanged;
#   3. a two-rank fit in the image (`torchrun --standalone --nproc-per-node 2`) as a non-root uid with no passwd entry
#      (`docker run --user UID:GID`, a host runs/ folder mounted at /runs), then check that the run folder on the host
#      belongs to that uid;
#   4. the same image with an unwritable /runs: the entrypoint's one-line error and exit 2.
# Run as root (debootstrap, dockerd): `sudo scripts/container/build-local.sh`. It installs debootstrap and docker.io
# with apt-get when missing and starts dockerd when none runs (and stops the one it started at the end).
#
# Time on this 2-core machine, measured (`time scripts/container/build-local.sh`, other jobs sharing the cores, load
# average 8-9): 5m40s from nothing but the installed tools (debootstrap 111 s, Python packages 71 s, docker import
# 114 s, docker build 16 s, the two-rank fit 25 s; apt-get adds its own time where the tools are missing); 47 s with
# the base kept from an earlier run (the default; REBUILD_BASE=1 makes it again) and the project changed; 26 s with
# nothing changed (docker's layer cache).
# CI does not run it: CI's whole .ci/run must stay under 15 minutes on 2 cores and already takes 10.5 (measured), and
# this needs root, a Docker daemon and downloads (Debian's packages, PyPI's wheels). Run it by hand after changing
# the Dockerfile, the entrypoint (docker/entrypoint.sh) or the dependencies; tests/test_container.py checks the
# entrypoint and the Dockerfile's wiring without Docker in every `make test`.
#
# What the local base lacks: torchvision has no CPU build here (its wheel needs torch's CUDA libraries: `import
# torchvision` fails), so only the models that do not use it load in this image: tiny (the demo's) and darknet19.
# The image made on the Dockerfile's default base (pytorch/pytorch, CUDA) has a working torchvision.
#
# Settings (environment): WORK (scratch folder, default /var/tmp/wsitrain-container), BASE_TAG, IMAGE_TAG,
# REBUILD_BASE=1, MIRROR (a Debian mirror for debootstrap; default: debootstrap's own), RUN_UID/RUN_GID (the uid the
# container runs as; default the caller's, under sudo the one who ran sudo, or 4321 when that is root: root's
# writes pass every permission check and so would hide the case this script is for).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${WORK:-/var/tmp/wsitrain-container}
SUITE=bookworm  # Python 3.11: the CPU torch wheel on this machine is cp311
BASE_TAG=${BASE_TAG:-wsitrain-base:bookworm-cpu}
IMAGE_TAG=${IMAGE_TAG:-wsitrain:local}
TORCH_SPEC=torch==2.13.0           # on this machine: torch-2.13.0+cpu, a local file (no CUDA packages)
TORCHVISION_SPEC=torchvision==0.28.0  # the torchvision release built against torch 2.13
RUN_UID=${RUN_UID:-${SUDO_UID:-$(id -u)}}
RUN_GID=${RUN_GID:-${SUDO_GID:-$(id -g)}}
if [ "$RUN_UID" = 0 ]; then RUN_UID=4321 RUN_GID=4321; fi
# Short: 8 synthetic slides of 256 px, one epoch, 128 px tiles (12 s for two ranks on the host, measured).
FIT_ARGS=(fit configs/demo.yaml --name two-rank --set data.synthetic.n=8 --set data.synthetic.size=256
          --set train.epochs=1 --set engine.tile_size=128)

die() { echo "build-local: $*" >&2; exit 1; }
step_start=$(date +%s)
all_start=$step_start
step() {
    local now; now=$(date +%s)
    echo "build-local: [$((now - step_start)) s] done"
    step_start=$now
    echo "build-local: == $*"
}

[ "$(id -u)" = 0 ] || die "run as root: debootstrap and dockerd need it (sudo $0)"
mkdir -p "$WORK"

step "tools: debootstrap, docker.io"
missing=()
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v dockerd >/dev/null || missing+=(docker.io)
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

started_dockerd=
stop_dockerd() {
    if [ -n "$started_dockerd" ]; then
        kill "$started_dockerd" 2>/dev/null || true
        wait "$started_dockerd" 2>/dev/null || true
    fi
}
trap stop_dockerd EXIT
if ! docker info >/dev/null 2>&1; then
    dockerd >"$WORK/dockerd.log" 2>&1 &
    started_dockerd=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
    docker info >/dev/null 2>&1 || die "dockerd did not start; its log: $WORK/dockerd.log"
fi

if [ -n "${REBUILD_BASE:-}" ] || ! docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
    rootfs=$WORK/rootfs
    rm -rf "$rootfs"
    step "debootstrap $SUITE into $rootfs"
    # shellcheck disable=SC2086  # MIRROR is optional: empty means debootstrap's default mirror
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$rootfs" ${MIRROR:-} \
        >"$WORK/debootstrap.log" 2>&1 || die "debootstrap failed; its log: $WORK/debootstrap.log"

    step "Python packages into $rootfs/opt/venv"
    # Downloaded by the host's pip: its configuration points at the local torch file and trusts this network's
    # certificates, which the fresh Debian does not. The host's Python is the chroot's (3.11, glibc >= 2.28), so the
    # wheels it picks install there; the chroot's pip then installs from that folder alone (--no-index).
    python3 -c 'import sys; assert sys.version_info[:2] == (3, 11)' \
        || die "the host's python3 must be 3.11 (bookworm's) to download wheels for the image"
    mapfile -t deps < <(python3 -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' "$REPO/pyproject.toml")
    wheels=$rootfs/tmp/wheels
    packages=("$TORCH_SPEC" "$TORCHVISION_SPEC" "${deps[@]}")
    python3 -m pip download --disable-pip-version-check --only-binary=:all: --dest "$wheels" "${packages[@]}" \
        >"$WORK/pip-download.log" 2>&1 || die "pip download failed; its log: $WORK/pip-download.log"
    torch_wheel=$(find "$wheels" -name 'torch-*.whl' | head -n 1)
    [ -n "$torch_wheel" ] || die "pip download $TORCH_SPEC gave no wheel"
    case "$torch_wheel" in
        *+cpu*) ;;
        *) echo "build-local: warning: $torch_wheel is not a CPU build; its CUDA packages come too (GBs)" >&2 ;;
    esac
    in_root() { chroot "$rootfs" env -i PATH=/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"; }
    in_root python3 -m venv /opt/venv
    in_root pip install -q --no-cache-dir --disable-pip-version-check --no-index --find-links /tmp/wheels \
        "${packages[@]}"
    # The Dockerfile's `pip install .` then needs nothing from an index: its dependencies are installed, and its
    # build backend (setuptools, wheel: build isolation installs them anew) comes from /opt/wheelhouse.
    python3 -m pip download --disable-pip-version-check --only-binary=:all: --dest "$rootfs/opt/wheelhouse" \
        "setuptools>=68" wheel >>"$WORK/pip-download.log" 2>&1 \
        || die "pip download failed; its log: $WORK/pip-download.log"
    printf '[global]\nno-index = true\nfind-links = /opt/wheelhouse\n' >"$rootfs/etc/pip.conf"
    rm -rf "$wheels" "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*

    step "docker import $BASE_TAG"
    tar -C "$rootfs" -c . | docker import \
        --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' - "$BASE_TAG" >/dev/null
    rm -rf "$rootfs"
else
    echo "build-local: base image $BASE_TAG kept from an earlier run (REBUILD_BASE=1 makes it again)"
fi

step "docker build --build-arg BASE=$BASE_TAG -t $IMAGE_TAG"
docker build -q --build-arg "BASE=$BASE_TAG" -t "$IMAGE_TAG" "$REPO" >/dev/null
docker run --rm "$IMAGE_TAG" --version

step "two-rank fit as uid $RUN_UID:$RUN_GID, host $WORK/runs at /runs"
runs=$WORK/runs
rm -rf "$runs"
mkdir -p "$runs"
chown "$RUN_UID:$RUN_GID" "$runs"
docker run --rm --user "$RUN_UID:$RUN_GID" -v "$runs:/runs" "$IMAGE_TAG" \
    torchrun --standalone --nproc-per-node 2 -m wsitrain.cli "${FIT_ARGS[@]}" >"$WORK/fit.log" 2>&1 \
    || { tail -n 30 "$WORK/fit.log"; die "the two-rank fit failed; its log: $WORK/fit.log"; }
run_dir=$runs/two-rank
for f in last.pt metrics.jsonl; do [ -f "$run_dir/$f" ] || die "$run_dir has no $f; the fit's log: $WORK/fit.log"; done
owner=$(stat -c %u:%g "$run_dir")
[ "$owner" = "$RUN_UID:$RUN_GID" ] || die "$run_dir belongs to $owner, not $RUN_UID:$RUN_GID"
foreign=$(find "$run_dir" \( ! -uid "$RUN_UID" -o ! -gid "$RUN_GID" \) | head -n 3)
[ -z "$foreign" ] || die "files in $run_dir not owned by $RUN_UID:$RUN_GID: $foreign"
echo "build-local: $run_dir and its $(find "$run_dir" -type f | wc -l) files belong to $owner"

step "an unwritable /runs (root's folder, mode 755) as uid $RUN_UID"
locked=$WORK/runs-locked
rm -rf "$locked"
mkdir -m 755 "$locked"
set +e
message=$(docker run --rm --user "$RUN_UID:$RUN_GID" -v "$locked:/runs" "$IMAGE_TAG" "${FIT_ARGS[@]}" 2>&1)
code=$?
set -e
echo "$message"
[ "$code" = 2 ] || die "expected exit 2 for an unwritable /runs, got $code"
case "$message" in
    *"/runs is not writable by uid $RUN_UID"*) ;;
    *) die "the message does not name /runs and uid $RUN_UID" ;;
esac
[ -z "$(ls -A "$locked")" ] || die "$locked is not empty"

step "finished"
echo "build-local: all passed in $(($(date +%s) - all_start)) s; image $IMAGE_TAG on base $BASE_TAG"
