#!/bin/sh
# make compose-check's Debian base image where public images cannot be pulled: bookworm by
# debootstrap with Python 3.11 as `python` and `pip` (as python:3.11-slim has them), imported
# as pdserve-base:bookworm. Usage: base.sh DIR (a cache; the tree is made once).
set -eu
dir=$1
if [ ! -x "$dir/usr/bin/python3" ]; then
    rm -rf "$dir"
    debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates,passwd bookworm "$dir" \
        http://deb.debian.org/debian >/dev/null
    ln -sf /usr/bin/python3 "$dir/usr/local/bin/python"
    ln -sf /usr/bin/pip3 "$dir/usr/local/bin/pip"
    printf '[global]\nbreak-system-packages = true\nroot-user-action = ignore\n' > "$dir/etc/pip.conf"
    rm -rf "$dir/var/cache/apt/archives"/*.deb "$dir/var/lib/apt/lists"/*
fi
tar -C "$dir" -c . | docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - pdserve-base:bookworm
