#!/usr/bin/env bash
# A stand-in for the Dockerfile's default base (python:3.11-slim) built from Debian's packages
# alone, for machines that reach Debian's archive but no image registry:
#   scripts/debian-base-image.sh [TAG]        (default specgate-base:bookworm; needs root, debootstrap)
#   docker build --build-arg BASE_IMAGE=specgate-base:bookworm -t specgate .
# Debian 12's Python is 3.11, as the official image's; `python` is python3.
# CA_BUNDLE=FILE: the image trusts that PEM bundle (a proxy's own CA) for apt, pip and Python.
set -euo pipefail
tag=${1:-specgate-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "debootstrap bookworm (minbase, python3) into $root" >&2
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" >&2
ln -sf python3 "$root/usr/bin/python"
changes=(--change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]')
if [ -n "${CA_BUNDLE:-}" ]; then
    cp "$CA_BUNDLE" "$root/etc/ssl/certs/ca-certificates.crt"
    changes+=(--change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt')
fi
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
echo "docker import -> $tag" >&2
tar -C "$root" -c . | docker import "${changes[@]}" - "$tag" >/dev/null
docker image inspect --format '{{.Id}} {{.Size}}' "$tag"
