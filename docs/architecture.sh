#!/bin/sh
# Render docs/architecture.svg from docs/architecture.dot with Graphviz (scripts/dev setup installs it).
#   sh docs/architecture.sh            rewrite docs/architecture.svg
#   sh docs/architecture.sh OUT.svg    render somewhere else (tests compare that with the committed one)
# The SVG records the sha256 of its source, so a pure unit test can tell when it is stale.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/architecture.svg}
sum=$(sha256sum "$here/architecture.dot" | cut -d' ' -f1)
dot -Tsvg "$here/architecture.dot" \
  | sed "s|^<svg |<!-- rendered from architecture.dot sha256 $sum by docs/architecture.sh -->\n<svg |" > "$out.tmp"
mv "$out.tmp" "$out"
