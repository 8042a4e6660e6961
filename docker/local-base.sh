#!/usr/bin/env bash
# Local stand-ins for the Debian base images our Dockerfiles start from, for machines with a
# Docker Engine but no image registry (CI and the development machines here).
#
#   docker/local-base.sh            # no arguments; creates only the images that are missing
#
# Each stand-in is a Debian root made with debootstrap (minbase) from Debian's packages as this
# machine's apt is configured (same suites, mirror and apt settings), imported with
# `docker import` under the real image's name. They are what those names are upstream: Debian
# bookworm, minimal, `slim` without documentation. Two additions, both needed to reach the
# package registries from inside a build here: the `ca-certificates` package and this
# machine's extra certificates (the ones `update-ca-certificates` installs from
# /usr/local/share/ca-certificates). Nothing else is named after an image it is not: the CUDA
# and Rust build stages use their own local names (see docker/build-full.sh).
#
# With a registry (users), none of this runs: `docker build` pulls the real images.
set -euo pipefail
cd "$(dirname "$0")/.."

SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# The names our Dockerfiles use.
IMAGES=(debian:bookworm-slim)

need=()
for image in "${IMAGES[@]}"; do
  if docker image inspect "$image" >/dev/null 2>&1; then
    echo "local-base: $image is there"
  else
    need+=("$image")
  fi
done
[ ${#need[@]} -eq 0 ] && exit 0

as_root=""
if [ "$(id -u)" != 0 ]; then as_root="sudo"; fi
if ! command -v debootstrap >/dev/null; then
  echo "local-base: installing debootstrap" >&2
  $as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq debootstrap >/dev/null
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/lipsync-base.XXXXXX")
cleanup() { $as_root rm -rf "$work"; }
trap cleanup EXIT

for image in "${need[@]}"; do
  root="$work/${image//[:\/]/_}"
  echo "local-base: debootstrap $SUITE (minbase) for $image" >&2
  start=$(date +%s)
  $as_root debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$root" "$MIRROR" \
    >"$work/debootstrap.log" 2>&1 || { tail -30 "$work/debootstrap.log" >&2; exit 1; }

  # apt inside the image as on this machine: sources and settings.
  $as_root rm -f "$root/etc/apt/sources.list"
  if [ -d /etc/apt/sources.list.d ]; then
    for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
      [ -f "$f" ] && $as_root cp "$f" "$root/etc/apt/sources.list.d/"
    done
  fi
  if [ -s /etc/apt/sources.list ]; then $as_root cp /etc/apt/sources.list "$root/etc/apt/"; fi
  for f in /etc/apt/apt.conf.d/*; do
    # Only settings that change how packages are fetched (proxies, dates, mirrors).
    if grep -qE '^\s*Acquire::' "$f" 2>/dev/null; then $as_root cp "$f" "$root/etc/apt/apt.conf.d/"; fi
  done

  # This machine's extra certificate authorities.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    $as_root mkdir -p "$root/usr/local/share/ca-certificates"
    $as_root cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    $as_root chroot "$root" update-ca-certificates >/dev/null
  fi

  # What Debian's own slim images leave out, and what a build would leave behind.
  $as_root chroot "$root" apt-get clean
  $as_root rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/tmp/*
  if [[ $image == *-slim ]]; then
    $as_root tee "$root/etc/dpkg/dpkg.cfg.d/docker-slim" >/dev/null <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
  fi

  $as_root tar -C "$root" -c . | docker import \
    --change 'CMD ["bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --message "local stand-in: debootstrap $SUITE minbase from $MIRROR" \
    - "$image" >/dev/null
  echo "local-base: $image made in $(( $(date +%s) - start )) s" \
    "($(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1/1e6}'))" >&2
  $as_root rm -rf "$root"
done
