#!/usr/bin/env bash
# Prepares an offline build of the farm's images, for a host that reaches a Debian mirror and PyPI
# (or their proxies) but no image registry, as behind a firewall; docker builds then need no network:
#   1. a Debian bookworm root file system holding what the images need from apt (debootstrap; needs
#      root), imported into Docker as farm-offline/bookworm:latest (the base of every image);
#   2. a wheelhouse of the image's Python requirements (docker/requirements.py), put into
#      docker/wheelhouse/, where the image build installs them from with --no-index.
# Both are cached in $FARM_DOCKER_CACHE [/var/cache/farm-docker] under a hash of what they hold.
# Then:  docker compose -f docker/docker-compose.yml -f docker/offline/compose.offline.yml up --build
# Usage: docker/offline/prepare.sh [PYTHON]
#   PYTHON builds the wheelhouse with its pip: the version of the images' Python, 3.11 for bookworm
#   [.venv/bin/python]. DEBIAN_MIRROR [http://deb.debian.org/debian]. docker: $DOCKER_HOST's engine.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${1:-$ROOT/.venv/bin/python}
CACHE=${FARM_DOCKER_CACHE:-/var/cache/farm-docker}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# g++: TVM links kernels with it; postgresql: the stand-in for the official postgres image.
PACKAGES=python3,python3-venv,g++,postgresql
IMAGE=farm-offline/bookworm

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9  # one preparation at a time per cache

log() { echo "prepare: $*" >&2; }

# Keys: what decides the content (ROOTFS_STEPS: bump it when the steps below change).
ROOTFS_STEPS=1
rootfs_key=$(echo "bookworm minbase $PACKAGES $ROOTFS_STEPS" | sha256sum | cut -c1-16)
rootfs=$CACHE/rootfs-bookworm-$rootfs_key.tar
if [[ ! -f $rootfs ]]; then
  log "building a Debian bookworm root file system with $PACKAGES (debootstrap: a few minutes)"
  tmp=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  debootstrap --variant=minbase --include="$PACKAGES" bookworm "$tmp/root" "$MIRROR" > "$tmp/debootstrap.log" 2>&1 \
    || { tail -n 20 "$tmp/debootstrap.log" >&2; exit 1; }
  # What an image never needs: downloaded packages and lists, docs, the package's default cluster
  # (the stand-in initialises its own in /var/lib/postgresql/data).
  rm -rf "$tmp"/root/var/cache/apt/archives/*.deb "$tmp"/root/var/lib/apt/lists/* "$tmp"/root/usr/share/doc \
    "$tmp"/root/usr/share/man "$tmp"/root/usr/share/locale "$tmp"/root/var/lib/postgresql/15/main \
    "$tmp"/root/etc/postgresql/15/main
  tar -C "$tmp/root" --numeric-owner -cf "$tmp/rootfs.tar" .
  mv "$tmp/rootfs.tar" "$rootfs"
  rm -rf "$tmp"
  trap - EXIT
fi
if ! docker image inspect "$IMAGE:$rootfs_key" >/dev/null 2>&1; then
  log "importing $rootfs as $IMAGE:$rootfs_key"
  docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' "$rootfs" "$IMAGE:$rootfs_key" >/dev/null
fi
docker tag "$IMAGE:$rootfs_key" "$IMAGE:latest"

requirements=$("$PYTHON" "$ROOT/docker/requirements.py" "$ROOT/pyproject.toml")
py_version=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
wheels_key=$(printf '%s\n%s\n' "$py_version" "$requirements" | sha256sum | cut -c1-16)
wheels=$CACHE/wheels-py$py_version-$wheels_key
if [[ ! -d $wheels ]]; then
  log "building the wheelhouse for Python $py_version into $wheels"
  tmp=$(mktemp -d "$CACHE/wheels.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  echo "$requirements" > "$tmp/requirements.txt"
  "$PYTHON" -m pip wheel --disable-pip-version-check -w "$tmp" -r "$tmp/requirements.txt" > "$tmp/pip.log" 2>&1 \
    || { tail -n 20 "$tmp/pip.log" >&2; exit 1; }
  rm "$tmp/requirements.txt" "$tmp/pip.log"
  mv "$tmp" "$wheels"
  trap - EXIT
fi
find "$ROOT/docker/wheelhouse" -name '*.whl' -delete
cp -l "$wheels"/*.whl "$ROOT/docker/wheelhouse/" 2>/dev/null || cp "$wheels"/*.whl "$ROOT/docker/wheelhouse/"
log "ready: $IMAGE:latest, $(ls "$wheels" | wc -l) wheels in docker/wheelhouse/"
