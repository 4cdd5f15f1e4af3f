"""Storage services amber-store runs against: real S3 servers as local processes (SeaweedFS,
rclone) and MinIO (docker compose)."""
