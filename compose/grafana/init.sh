#!/bin/sh
# Grafana's entrypoint in the kit: no default admin password. Use secrets/grafana_admin_password
# when it exists; else generate one on first start, keep it in the data volume and print it once.
set -eu
secret=/run/kit-keys/grafana_admin_password
kept="${GF_PATHS_DATA:-/var/lib/grafana}/.kit-admin-password"
if [ -s "$secret" ]; then
  GF_SECURITY_ADMIN_PASSWORD="$(head -n 1 "$secret")"
elif [ -s "$kept" ]; then
  GF_SECURITY_ADMIN_PASSWORD="$(cat "$kept")"
else
  GF_SECURITY_ADMIN_PASSWORD="$(od -An -N18 -tx1 /dev/urandom | tr -d ' \n')"
  umask 077
  printf '%s' "$GF_SECURITY_ADMIN_PASSWORD" >"$kept"
  echo "grafana: generated admin password (user admin): $GF_SECURITY_ADMIN_PASSWORD"
  echo "grafana: it is kept in the grafana-data volume; put your own in secrets/grafana_admin_password"
fi
export GF_SECURITY_ADMIN_PASSWORD
exec /run.sh "$@"
