#!/usr/bin/env bash
# The README's picture of `dflash report --compare --html` (docs/report.png): two runs of the tiny
# config at two learning rates, their page, and a screenshot of it by headless Chromium
# (Debian: apt install chromium; CHROMIUM=/path/to/chrome for another one). About a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
browser=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)}
[ -n "$browser" ] || { echo "report_screenshot: no Chromium found (apt install chromium, or set CHROMIUM)" >&2; exit 1; }
out=$(mktemp -d)
for lr in 2e-2 2e-3; do
  bin/dflash run configs/tiny.toml --set "run.output_dir=\"$out\"" --set "run.name=\"lr $lr\"" \
    --set optimizer.lr=$lr --set profile.interval_s=1 > /dev/null
done
bin/dflash report --compare "$out/lr 2e-2" "$out/lr 2e-3" --html "$out/report.html" > /dev/null
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1600,1500 \
  --screenshot="$PWD/docs/report.png" "file://$out/report.html" 2> /dev/null
echo "report_screenshot: docs/report.png (the page: $out/report.html)"
