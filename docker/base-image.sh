#!/usr/bin/env bash
# Make the local base image diloco-base:bookworm: Debian bookworm (minbase) with Python 3.11 and
# its venv module, from a Debian archive, for machines that reach no image registry (the
# Dockerfile's default base, python:3.11-slim, comes from an image registry). Needs root and
# debootstrap (installed with apt-get when missing). An image already there is kept.
#
# The archive is DEBIAN_MIRROR if set (e.g. DEBIAN_MIRROR=http://<your mirror>/debian), else
# the one this machine's apt already uses for bookworm: the first enabled `deb` source of the
# suite bookworm in $APT_DIR/sources.list, then $APT_DIR/sources.list.d/*.list (one-line format)
# and *.sources (deb822 format); APT_DIR is /etc/apt unless set.
#
#   sudo bash docker/base-image.sh [IMAGE]        # make IMAGE (default diloco-base:bookworm)
#   bash docker/base-image.sh --print-mirror      # only print the archive it would use
set -euo pipefail
SUITE=bookworm
APT_DIR=${APT_DIR:-/etc/apt}

# The URIs (http, https or file) of the enabled `deb` sources of the suite $1, one a line.
apt_source_uris() {
    local suite=$1 file
    local -a files=()
    shopt -s nullglob
    [ -f "$APT_DIR/sources.list" ] && files+=("$APT_DIR/sources.list")
    files+=("$APT_DIR"/sources.list.d/*.list "$APT_DIR"/sources.list.d/*.sources)
    shopt -u nullglob
    for file in "${files[@]}"; do
        case $file in
            *.sources) awk -v suite="$suite" "$DEB822" "$file" ;;
            *) awk -v suite="$suite" "$ONE_LINE" "$file" ;;
        esac
    done | grep -E '^(https?|file):' || true
}

# `deb [options] URI SUITE COMPONENT...`; the options in brackets may hold spaces.
ONE_LINE='
{
    sub(/#.*/, "")
    gsub(/\[[^]]*\]/, "")
    if ($1 == "deb" && $3 == suite) print $2
}'

# Stanzas separated by blank lines; "Key: value" fields, a value going on over lines that start
# with a space; "#" starts a comment line. Types, URIs and Suites are lists.
DEB822='
function has(list, word,    n, words, i) {
    n = split(list, words, /[ \t]+/)
    for (i = 1; i <= n; i++) if (words[i] == word) return 1
    return 0
}
BEGIN { RS = ""; FS = "\n" }
{
    split("", field)
    key = ""
    for (i = 1; i <= NF; i++) {
        if ($i ~ /^#/) continue
        if ($i ~ /^[ \t]/) { if (key != "") field[key] = field[key] " " $i; continue }
        colon = index($i, ":")
        if (colon == 0) continue
        key = tolower(substr($i, 1, colon - 1))
        field[key] = substr($i, colon + 1)
    }
    if (field["enabled"] ~ /^[ \t]*no[ \t]*$/) next
    if (!has(field["types"], "deb") || !has(field["suites"], suite)) next
    n = split(field["uris"], uris, /[ \t]+/)
    for (i = 1; i <= n; i++) if (uris[i] != "") print uris[i]
}'

# The Debian archive to debootstrap from (see the top); fails, saying how to name one, if none.
debian_mirror() {
    local found
    if [ -n "${DEBIAN_MIRROR:-}" ]; then
        echo "$DEBIAN_MIRROR"
        return
    fi
    found=$(apt_source_uris "$SUITE")
    if [ -z "$found" ]; then
        echo "base-image.sh: no Debian archive for $SUITE: DEBIAN_MIRROR is not set, and no" \
            "enabled 'deb' source of the suite $SUITE is in $APT_DIR/sources.list or" \
            "$APT_DIR/sources.list.d/*.list|*.sources. Name one: DEBIAN_MIRROR=<URL of a" \
            "Debian archive, e.g. http://<mirror>/debian> bash docker/base-image.sh" >&2
        return 1
    fi
    echo "${found%%$'\n'*}"
}

if [ "${1:-}" = --print-mirror ]; then
    debian_mirror
    exit
fi
IMAGE=${1:-diloco-base:bookworm}
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base image $IMAGE: already there"
    exit 0
fi
MIRROR=$(debian_mirror)
if ! command -v debootstrap >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "base image $IMAGE: debootstrap $SUITE from $MIRROR (about a minute)"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$root" "$MIRROR" >/dev/null
tar -C "$root" -c . | docker import -c 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
echo "base image $IMAGE: made"
