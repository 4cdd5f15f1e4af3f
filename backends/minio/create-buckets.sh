#!/bin/sh
# One-shot bootstrap for the compose MinIO: create the buckets amber-store and its tests use.
set -eu
mc alias set local http://minio:9000 "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD"
for b in $AMBER_BUCKETS; do
  mc mb --ignore-existing "local/$b"
done
echo "buckets ready: $AMBER_BUCKETS"
