#!/usr/bin/env bash
# `make prometheus`: a local Prometheus that scrapes the running gateway, with the shipped alert
# rules (dashboards/alerts.yml) loaded. Installs Prometheus first when missing
# (scripts/ensure-prometheus.sh). Runs in the foreground until Ctrl-C; data is kept in $DATA so a
# restart keeps the history `loopwarden capacity` reads.
#
# Settings (environment, or `make prometheus TARGET=...`):
#   TARGET    the gateway's host:port to scrape            (default 127.0.0.1:8080, what `make run` serves)
#   PORT      Prometheus' own listen port on 127.0.0.1      (default 9090)
#   INTERVAL  scrape and rule evaluation interval           (default 5s)
#   DATA      config + TSDB directory                       (default .prometheus in the repository)
# Then: loopwarden capacity --prometheus http://127.0.0.1:$PORT --report capacity.html
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${TARGET:-127.0.0.1:8080}
PORT=${PORT:-9090}
INTERVAL=${INTERVAL:-5s}
DATA=${DATA:-$here/.prometheus}

bash "$here/scripts/ensure-prometheus.sh" >&2
mkdir -p "$DATA"
cat >"$DATA/prometheus.yml" <<YAML
global:
  scrape_interval: $INTERVAL
  evaluation_interval: $INTERVAL
rule_files:
  - $here/dashboards/alerts.yml
scrape_configs:
  - job_name: loopwarden
    static_configs:
      - targets: ['$TARGET']
YAML
promtool check config "$DATA/prometheus.yml" >&2
printf 'run-prometheus: scraping %s every %s; Prometheus on http://127.0.0.1:%s (Ctrl-C stops it)\n' \
    "$TARGET" "$INTERVAL" "$PORT" >&2
exec prometheus --config.file="$DATA/prometheus.yml" --storage.tsdb.path="$DATA/data" \
    --web.listen-address="127.0.0.1:$PORT" --log.level=warn
