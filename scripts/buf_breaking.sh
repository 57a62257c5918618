#!/usr/bin/env bash
# `make buf-breaking`: the protos must stay wire- and source-compatible with the base
# commit, so a service-to-service client is never broken silently (changes are additive).
#
# Base: $BUF_BREAKING_AGAINST when set; on main (or when HEAD is main's tip) the previous
# commit of main (first parent); on a branch the merge base with main. The base's protos
# are built into a local image (`buf build -o`), so nothing is fetched: it works offline.
set -euo pipefail
cd "$(dirname "$0")/.."
BUF=${BUF:-.tools/node_modules/.bin/buf}

base=${BUF_BREAKING_AGAINST:-}
if [ -z "$base" ]; then
  head=$(git rev-parse HEAD)
  if git rev-parse -q --verify main >/dev/null; then
    merge_base=$(git merge-base HEAD main || true)
    if [ -n "$merge_base" ] && [ "$merge_base" != "$head" ]; then
      base=$merge_base
    fi
  fi
  if [ -z "$base" ]; then
    base=$(git rev-parse -q --verify 'HEAD^1' || true)
  fi
fi
if [ -z "$base" ]; then
  echo "buf-breaking: no earlier commit to compare with (first commit or shallow clone); skipped"
  exit 0
fi
if ! git cat-file -e "$base:protos" 2>/dev/null; then
  echo "buf-breaking: $(git rev-parse --short "$base") has no protos/; nothing to compare"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git archive "$base" protos buf.yaml | tar -x -C "$tmp"
"$BUF" build "$tmp" -o "$tmp/base.binpb"
"$BUF" breaking --against "$tmp/base.binpb"
echo "buf-breaking: protos are compatible with $(git rev-parse --short "$base")"
