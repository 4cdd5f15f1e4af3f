"""Storage services amber-store runs against: MinIO (docker compose) and a loopback S3 server."""
