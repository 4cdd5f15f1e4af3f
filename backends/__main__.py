"""Run one of the test suite's storage servers by hand: it prints its endpoint and the storage
options to open a store there, then serves until Ctrl-C or SIGTERM, and removes its data folder
(unless --data-dir named one)."""

from __future__ import annotations

import argparse
import json
import signal
import time

from .azurite import Azurite
from .gcs import FakeGCS
from .s3servers import RcloneS3, SeaweedFS

SERVERS = {"seaweedfs": SeaweedFS, "rclone": RcloneS3, "fake-gcs": FakeGCS, "azurite": Azurite}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m backends", description=" ".join(__doc__.split()))
    p.add_argument("--server", choices=sorted(SERVERS), default="seaweedfs",
                   help="seaweedfs and rclone: S3; fake-gcs: Google Cloud Storage; azurite: Azure Blob Storage")
    p.add_argument("--data-dir", help="keep the data here (default: a fresh temporary directory)")
    p.add_argument("--bucket", action="append", default=[], help="bucket (container) to create (repeatable)")
    args = p.parse_args()
    # SIGTERM (a `kill`, a CI runner's end) stops the server as Ctrl-C does, so that its data
    # folder (a temporary one) is removed rather than left behind
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with SERVERS[args.server](args.data_dir) as server:
        for b in args.bucket:
            server.create_bucket(b)
        bucket = args.bucket[0] if args.bucket else "BUCKET"
        print(f"{server.name} at {server.endpoint} (data {server.data_dir}); Ctrl-C stops it\n"
              f"  amber.open('{server.scheme}://{bucket}/run', {json.dumps(server.storage_options())})", flush=True)
        try:
            while server.running:
                time.sleep(1)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
